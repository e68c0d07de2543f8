"""Checks that run before a long boot, so a bad setup fails in seconds with a message that says what to change.

- the pack verifies (format.verify_pack: every file and tensor header, codebook markers);
- the kernel backend named in VLLM_EXL3_KERNEL is usable here (built for this GPU, installed);
- a speculative method in --speculative-config has what it drafts from: `mtp` the pack's own MTP layers,
  `eagle3`/`eagle` a bf16 draft head that fits the pack, `suffix` the arctic-inference package;
- vLLM's own model config accepts the options against the pack (a --max-model-len above the model's maximum, a
  `non_routed_quantization` method this vLLM lacks: launch.py, from vllm_options.VllmOptions.model_refusal);
- the network names exist: NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME interfaces, NCCL_IB_HCA devices, and
  VLLM_HOST_IP is an address of this machine on the interface NCCL was told to use;
- two nodes: on the head, the head address is its own; on the worker, traffic to the head leaves through that
  interface and the head's rendezvous port answers (waiting for it while the head boots);
- the unified-memory plan (memory_plan.py) against the memory that is free right now.

Every function takes the environment and the filesystem root as arguments, so tests run them for real against
fixture packs, the machine's own loopback interface and fake sysfs trees or meminfo files.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..base import settings
from ..format.eagle_head import EagleHead, open_head
from ..format.pack import Pack, verify_pack
from ..kernels.requested import KERNEL_ENV, parse_kernel
from .memory_plan import MemoryFigures, ModelShape, Plan, PlanSettings, Request, gib, model_max_len
from .memory_plan import plan as make_plan

# A refusal should fit on a screen: the first problems of a broken pack say enough.
MAX_PACK_PROBLEMS = 8
HEAD_PROBE_INTERVAL_S = 2.0
HEAD_PROGRESS_EVERY_S = 30.0


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    checked: bool = True  # False: deliberately not checked (the detail says why); does not fail the report
    warning: bool = False  # ok, but worth the operator's attention (printed as WARN)


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    plan: Plan | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks) and (self.plan is None or self.plan.fits)

    def lines(self) -> list[str]:
        out = [f"preflight: {'--  ' if not c.checked else 'FAIL' if not c.ok else 'WARN' if c.warning else 'ok  '} "
               f"{c.name}: {c.detail}"
               for c in self.checks]
        out += [f"preflight: note {n}" for n in self.notes]
        if self.plan is not None:
            out += [f"memory plan: {line}" for line in self.plan.lines]
            out += [f"memory plan: REFUSED: {p}" for p in self.plan.problems]
            out += [f"memory plan: to fix: {a}" for a in self.plan.advice]
        return out


# ---------------------------------------------------------------------------------------------------------------
# The pack
# ---------------------------------------------------------------------------------------------------------------
def check_pack(model_dir: str | os.PathLike) -> tuple[Check, Pack | None]:
    pack, problems = verify_pack(model_dir)
    if problems:
        shown = "; ".join(str(p) for p in problems[:MAX_PACK_PROBLEMS])
        more = f" (+{len(problems) - MAX_PACK_PROBLEMS} more)" if len(problems) > MAX_PACK_PROBLEMS else ""
        return Check("pack", False, f"{len(problems)} problem(s): {shown}{more}; "
                                    f"run `vllm-exl3 verify {model_dir}` for all"), None
    assert pack is not None
    size = sum(f.size for f in pack.files)
    return Check("pack", True, f"{model_dir}: {pack.architecture}, {len(pack.linears())} EXL3 linears, "
                               f"{len(pack.files)} file(s), {gib(size)}"), pack


def model_shape(pack: Pack, mtp: bool = False) -> ModelShape:
    """The pack's shape for the memory plan. Its MTP layers' tensors count (as stored), and their attention's KV,
    only with `mtp` (vLLM's `mtp` drafter loads them; the target alone skips them)."""
    from ..format.summary import summarize

    summary = summarize(pack)
    largest = max((lin.in_padded * lin.out_padded for lin in pack.linears().values()), default=0)
    mtp_layers, mtp_bytes = pack.mtp_storage()
    weights = summary.total_bytes if mtp else summary.total_bytes - mtp_bytes
    return ModelShape.from_config(pack.text_config, weights, largest_linear_bytes=2 * largest,
                                  max_len=pack_max_len(pack), mtp_layers=mtp_layers if mtp else 0,
                                  mtp_weight_bytes=mtp_bytes if mtp else 0)


def pack_max_len(pack: Pack) -> int | None:
    """The model's maximum context, from its config and its tokenizer's (the pack ships both)."""
    tokenizer_config = pack.root / "tokenizer_config.json"
    try:
        tok = json.loads(tokenizer_config.read_text()) if tokenizer_config.is_file() else None
    except (OSError, ValueError):
        tok = None
    return model_max_len(pack.text_config, tok)


# ---------------------------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------------------------
def _drafts_from_own_mtp(method: str) -> bool:
    """vLLM's `mtp`, and the per-model names it takes for it (glm4_moe_mtp, qwen3_5_mtp, ...: MTPModelTypes in
    vLLM's config/speculative.py), all draft with the target's own MTP layers."""
    return method == "mtp" or method.endswith("_mtp")


EAGLE_METHODS = ("eagle", "eagle3")  # a separate draft head (docs/vllm-notes.md §10)


def check_speculative(pack: Pack, config: Any, flag: str = "--speculative-config",
                      eagle3_target: bool | None = None) -> Check | None:
    """`config`: the speculative config vLLM's parser read (a dict; None without speculative decoding). Refuses
    what would fail minutes into the boot or, worse, boot: `mtp` on a pack without MTP layers crashes vLLM's
    worker (GLM: no num_nextn_predict_layers) or drafts with random weights; `suffix` without arctic-inference
    stops vLLM with an ImportError; an `eagle3`/`eagle` head that does not fit the pack (check_eagle_head).
    `eagle3_target`: whether vLLM's class for the pack's architecture supports EAGLE-3 (vLLM's own registry,
    read by the options' parser: vllm_options.VllmOptions.eagle3_target), None when not known."""
    if not isinstance(config, dict):
        return None
    method = str(config.get("method") or "")
    if method in EAGLE_METHODS:
        problem = eagle_head_problem(pack, config, eagle3_target)
        if problem is not None:
            return Check("speculative", False, f"{flag} asks for method {method!r}, a separate draft head, but "
                                               f"{problem}")
    if drafts_from_own_mtp(pack, config):
        missing = pack.mtp_missing()
        if missing:
            return Check("speculative", False,
                         f"{flag} asks for method {method!r}, a draft from the pack's own MTP layers, but "
                         f"{pack.root} ({pack.architecture}) has none: {missing}. Method 'ngram' needs no draft "
                         "weights")
    if method == "suffix" and importlib.util.find_spec("arctic_inference") is None:
        return Check("speculative", False,
                     f"{flag} asks for method 'suffix', which needs the arctic-inference package, not installed "
                     "here (vLLM stops at boot without it). Use method 'ngram'")
    tokens = config.get("num_speculative_tokens", "?")
    return Check("speculative", True, f"method {method or '(vLLM detects it)'}, {tokens} draft token(s) a step")


def eagle_head_problem(pack: Pack, config: dict, eagle3_target: bool | None = None) -> str | None:
    """What stops the head in `config["model"]` from drafting for this pack, None when nothing does. vLLM builds
    the head from its own config and quantization (none for a bf16 head: its linears get vLLM's unquantized
    method, the EXL3 config is never asked); it fails only once the weights load or at the first step: an `fc`
    or a concatenation of the wrong width (a head trained for another target), a target layer the head reads
    that the pack lacks, a target class without EAGLE-3's auxiliary hidden states (RuntimeError in vLLM's model
    runner), an EXL3 head (untested here: the plugin serves EXL3 targets)."""
    head, why = open_head(config.get("model"))
    if head is None:
        return f"{why}. Give 'model' the directory of a bf16 EAGLE head trained for this model"
    assert isinstance(head, EagleHead)
    where = head.root / "config.json"
    if str(config.get("quantization") or "").lower() == "exl3" or (head.quant_method or "").lower() == "exl3":
        return (f"the head is to be served as EXL3 ({where}: quantization_config "
                f"{head.quant_method!r}; speculative config quantization {config.get('quantization')!r}): the "
                "plugin serves EXL3 targets with a bf16 head, give the head unquantized")
    tc = pack.text_config
    hidden, layers = tc.get("hidden_size"), int(tc.get("num_hidden_layers") or 0)
    if head.target_hidden_size != hidden:
        return (f"{where} has target_hidden_size {head.target_hidden_size} (hidden_size {head.hidden_size}), "
                f"and {pack.root} ({pack.architecture}) has hidden_size {hidden}: the head was made for another "
                "model")
    if str(config.get("method")) == "eagle3" and head.uses_aux_hidden_states:
        # An id outside 0..n or named twice leaves `fc` narrower input than it takes, which fails after the boot
        # (docs/vllm-notes.md §10); where vLLM's runners read the head's config differently, every reading must
        # hold.
        for ids in map(list, head.aux_layer_id_readings(layers)):
            if any(not 0 <= i <= layers for i in ids) or len(set(ids)) != len(ids):
                return (f"{where} reads the target's hidden states after layers {ids} (its "
                        "eagle_aux_hidden_state_layer_ids, as a vLLM model runner reads them, or vLLM's default "
                        f"when absent), and {pack.root} has {layers} layers: ids must be distinct, within "
                        f"0..{layers}; name them at the top level of the head's config as "
                        "eagle_aux_hidden_state_layer_ids, which every vLLM runner reads, or the head was made for "
                        "another model")
        if eagle3_target is False:
            return (f"vLLM has no EAGLE-3 support for {pack.root}'s architecture {pack.architecture} (its model "
                    "class does not implement SupportsEagle3, which gives the head the target's hidden states)")
    return None


# ---------------------------------------------------------------------------------------------------------------
# The kernel backend
# ---------------------------------------------------------------------------------------------------------------
def check_kernel(env: Mapping[str, str]) -> Check | None:
    """A backend named in VLLM_EXL3_KERNEL must be usable here: the plugin refuses it at load time otherwise,
    minutes into the boot (`auto` always finds one, down to the torch reference)."""
    try:
        name = parse_kernel(settings.get(KERNEL_ENV, env))
    except ValueError as e:
        return Check("kernel backend", False, str(e))
    if name == "auto":
        return None  # without importing torch: the launcher stays quick when nothing needs checking
    from ..kernels.backend import get_backend

    try:
        reason = get_backend(name).unavailable_reason()
    except KeyError:
        reason = "not installed"
    return Check("kernel backend", reason is None, f"{name}: {reason or 'available'}"
                 + ("; use the image's build for this GPU, or another KERNEL" if reason else ""))


# ---------------------------------------------------------------------------------------------------------------
# Network names and addresses
# ---------------------------------------------------------------------------------------------------------------
def interface_addresses() -> dict[str, set[str]]:
    """IPv4/IPv6 addresses by interface name, as the kernel reports them now."""
    import psutil  # a vLLM dependency, so present wherever the launcher runs

    return {name: {a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}
            for name, addrs in psutil.net_if_addrs().items()}


def _list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def nccl_interfaces(spec: str, existing: list[str]) -> tuple[list[str], list[str]]:
    """Resolve an NCCL_SOCKET_IFNAME value (NCCL's syntax: prefixes, `=` exact, `^` exclude) -> (matched, unmatched)."""
    if spec.startswith("^"):
        return [n for n in existing if not any(n.startswith(p) for p in _list(spec[1:]))], []
    exact = spec.startswith("=")
    matched, unmatched = [], []
    for item in _list(spec.lstrip("=")):
        hits = [n for n in existing if (n == item if exact else n.startswith(item))]
        (matched.extend(hits) if hits else unmatched.append(item))
    return matched, unmatched


def ib_devices(spec: str) -> list[str]:
    """Device names in an NCCL_IB_HCA value: `[^][=]dev[:port],...`."""
    if spec.startswith("^"):
        return []  # an exclusion list names nothing that must exist
    return [item.split(":")[0] for item in _list(spec.lstrip("="))]


def check_network(env: Mapping[str, str], root: Path = Path("/"),
                  addresses: Callable[[], dict[str, set[str]]] = interface_addresses) -> list[Check]:
    """Interfaces and RDMA devices named in the environment exist; VLLM_HOST_IP is ours, on NCCL's interface."""
    net = root / "sys/class/net"
    existing = sorted(p.name for p in net.iterdir()) if net.is_dir() else []
    checks: list[Check] = []
    nccl_ifaces: list[str] = []
    if env.get("NCCL_SOCKET_IFNAME"):
        nccl_ifaces, missing = nccl_interfaces(env["NCCL_SOCKET_IFNAME"], existing)
        checks.append(Check("NCCL_SOCKET_IFNAME", not missing and bool(nccl_ifaces),
                            f"{env['NCCL_SOCKET_IFNAME']} -> {', '.join(nccl_ifaces) or 'nothing'}"
                            + (f"; no interface {', '.join(missing)} (have: {', '.join(existing)})" if missing else "")))
    if env.get("GLOO_SOCKET_IFNAME"):
        missing = [n for n in _list(env["GLOO_SOCKET_IFNAME"]) if n not in existing]
        checks.append(Check("GLOO_SOCKET_IFNAME", not missing,
                            env["GLOO_SOCKET_IFNAME"]
                            + (f": no interface {', '.join(missing)} (have: {', '.join(existing)})" if missing else "")))
    if env.get("NCCL_IB_HCA"):
        ib = root / "sys/class/infiniband"
        have = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
        missing = [d for d in ib_devices(env["NCCL_IB_HCA"]) if not any(h.startswith(d) for h in have)]
        checks.append(Check("NCCL_IB_HCA", not missing,
                            env["NCCL_IB_HCA"] + (f": no RDMA device {', '.join(missing)} (have: "
                                                  f"{', '.join(have) or 'none; is /dev/infiniband passed in?'}; "
                                                  "`ibdev2netdev` lists them)" if missing else "")))
    host_ip = env.get("VLLM_HOST_IP")
    if host_ip:
        by_iface = addresses()
        owners = sorted(n for n, addrs in by_iface.items() if host_ip in addrs)
        if not owners:
            checks.append(Check("VLLM_HOST_IP", False, f"{host_ip} is not an address of this machine "
                                f"(`ip -4 addr show {nccl_ifaces[0] if nccl_ifaces else '<nic>'}` shows the right one)"))
        elif nccl_ifaces and not set(owners) & set(nccl_ifaces):
            checks.append(Check("VLLM_HOST_IP", False, f"{host_ip} is on {', '.join(owners)}, not on the NCCL "
                                f"interface {', '.join(nccl_ifaces)}: the two must name the same link"))
        else:
            checks.append(Check("VLLM_HOST_IP", True, f"{host_ip} on {', '.join(owners)}"))
    return checks


def interface_networks() -> dict[str, list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]]:
    """Addresses with their prefixes, by interface name."""
    import psutil

    out: dict[str, list] = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and a.netmask:
                try:
                    out.setdefault(name, []).append(ipaddress.ip_interface(f"{a.address.split('%')[0]}/{a.netmask}"))
                except ValueError:
                    continue
    return out


def arp_neighbours(root: Path, iface: str) -> set[str]:
    """IPv4 neighbours the kernel has resolved on iface (/proc/net/arp, flags 0x2 = complete)."""
    try:
        rows = (root / "proc/net/arp").read_text().splitlines()[1:]
    except OSError:
        return set()
    return {c[0] for c in (r.split() for r in rows) if len(c) >= 6 and c[5] == iface and int(c[2], 16) & 0x2}


# A point-to-point subnet: two hosts and nothing else (RFC 3021 /31, the classic /30; /127 for IPv6, RFC 6164).
POINT_TO_POINT_PREFIX = {4: 30, 6: 126}


def check_point_to_point(local_addr: str, peer_addr: str | None, root: Path = Path("/"),
                         networks: Callable[[], dict[str, list]] = interface_networks) -> Check:
    """The fabric link should reach only the peer: the rendezvous port (and NCCL's) accept anyone who can connect,
    with no authentication. A /30 or /31 subnet, or exactly one neighbour on the interface, is a point-to-point
    link; anything else is a warning (the firewall snippet in docs/appliance.md closes the ports)."""
    try:
        local = ipaddress.ip_address(local_addr)
    except ValueError:
        return Check("point-to-point link", True, f"{local_addr!r} is not an IP address: not checked", checked=False)
    for iface, addrs in networks().items():
        for net in addrs:
            if net.ip != local:
                continue
            if net.network.prefixlen >= POINT_TO_POINT_PREFIX[net.version]:
                return Check("point-to-point link", True, f"{local_addr} on {iface} is in {net.network}")
            neighbours = arp_neighbours(root, iface)
            if len(neighbours) == 1 and (peer_addr is None or neighbours == {peer_addr}):
                return Check("point-to-point link", True, f"{iface} ({net.network}) has one neighbour, "
                                                           f"{next(iter(neighbours))}")
            return Check("point-to-point link", True, warning=True, detail=(
                f"{local_addr} on {iface} is in {net.network} with {len(neighbours)} neighbour(s) seen: the "
                "unauthenticated rendezvous and NCCL ports are reachable by more than the peer. Use a /30 or /31 "
                "on the direct cable, or admit only the peer with the host firewall (docs/appliance.md)"))
    return Check("point-to-point link", True, f"{local_addr} is on no interface here: not checked", checked=False)


def route_source(addr: str, port: int) -> str | None:
    """The local address the kernel would send from to reach addr (a UDP connect sends no packet)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, port))
            return s.getsockname()[0]
    except OSError:
        return None


def check_head_is_local(head_addr: str, addresses: Callable[[], dict[str, set[str]]] = interface_addresses) -> Check:
    owners = sorted(n for n, addrs in addresses().items() if head_addr in addrs)
    if owners:
        return Check("head address", True, f"{head_addr} is this machine's ({', '.join(owners)})")
    return Check("head address", False, f"{head_addr} is not an address of this machine: on the head, HEAD_ADDR "
                                        "must be this Spark's own address on the fabric link")


def wait_for_port(addr: str, port: int, timeout_s: float, *, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep, log: Callable[[str], None] = print) -> float | None:
    """Seconds until addr:port accepted a TCP connection, or None after timeout_s (0 = one attempt)."""
    start = clock()
    last_log = start
    while True:
        try:
            with socket.create_connection((addr, port), timeout=HEAD_PROBE_INTERVAL_S):
                return clock() - start
        except OSError:
            pass
        now = clock()
        if now - start >= timeout_s:
            return None
        if now - last_log >= HEAD_PROGRESS_EVERY_S:
            log(f"preflight: still waiting for the head at {addr}:{port} ({now - start:.0f}s of {timeout_s:.0f}s)")
            last_log = now
        sleep(HEAD_PROBE_INTERVAL_S)


def check_head_reachable(head_addr: str, port: int, host_ip: str | None, wait_s: float | None,
                         log: Callable[[str], None] = print) -> list[Check]:
    """The route to the head, then its rendezvous port (waiting up to wait_s; None: not probed, as in a dry run
    that may come before the head is up)."""
    checks = []
    source = route_source(head_addr, port)
    if source is None:
        return [Check("route to head", False, f"no route to {head_addr}: check HEAD_ADDR and the link "
                                              "(`ip route get HEAD_ADDR`)")]
    if host_ip and source != host_ip:
        checks.append(Check("route to head", False, f"traffic to {head_addr} would leave from {source}, not from "
                                                    f"VLLM_HOST_IP {host_ip}: the fabric link is not the route "
                                                    "(wrong NIC, or both ports in one subnet)"))
        return checks
    checks.append(Check("route to head", True, f"{head_addr} via {source}"))
    if wait_s is None:
        checks.append(Check("head rendezvous", True, f"{head_addr}:{port} not checked (dry run: the head need not "
                                                     "be up yet; `launch` waits for it)", checked=False))
        return checks
    waited = wait_for_port(head_addr, port, wait_s, log=log)
    if waited is None:
        checks.append(Check("head rendezvous", False,
                            f"nothing answers at {head_addr}:{port} after {wait_s:.0f}s: start the head first "
                            "(`docker compose --profile head up -d` on the other Spark), check HEAD_ADDR, "
                            "MASTER_PORT and the firewall"))
    else:
        checks.append(Check("head rendezvous", True, f"{head_addr}:{port} answered after {waited:.0f}s"))
    return checks


# ---------------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------------
def gpu_present(root: Path = Path("/")) -> bool:
    """An NVIDIA GPU is visible (the memory plan is enforced only then: vLLM's CPU build sizes KV otherwise)."""
    gpus = root / "proc/driver/nvidia/gpus"
    return (gpus.is_dir() and any(gpus.iterdir())) or (root / "dev/nvidiactl").exists()


def drafts_from_own_mtp(pack: Pack, config: Any) -> bool:
    """The speculative config vLLM's parser read (None without one) drafts from this pack's own MTP layers."""
    return isinstance(config, dict) and _drafts_from_own_mtp(str(config.get("method") or "")) \
        and config.get("model") in (None, str(pack.root))


def drafts_from_head(config: Any) -> EagleHead | None:
    """The separate draft head the speculative config vLLM's parser read drafts with (`eagle3`, `eagle`), None
    without one or when it cannot be read (check_speculative refuses that)."""
    if not isinstance(config, dict) or str(config.get("method") or "") not in EAGLE_METHODS:
        return None
    return open_head(config.get("model"))[0]


def with_draft_head(shape: ModelShape, head: EagleHead | None) -> ModelShape:
    """`shape` plus a draft head's weights as stored and its decoder layers' KV (vLLM loads the head beside the
    target and gives each of its attention layers a KV cache as long as the target's)."""
    if head is None:
        return shape
    return replace(shape, weight_bytes=shape.weight_bytes + head.weight_bytes,
                   draft_head_weight_bytes=head.weight_bytes, draft_head_layers=head.num_layers,
                   draft_head_kv_heads=head.num_kv_heads, draft_head_dim=head.head_dim)


def memory_plan(pack: Pack, request: Request, settings: PlanSettings, mem: MemoryFigures,
                speculative: Any = None) -> Plan:
    """`speculative`: the speculative config vLLM's parser read (None without one); `mtp` adds the MTP layers'
    weights and KV (model_shape), `eagle3`/`eagle` the draft head's (with_draft_head)."""
    shape = with_draft_head(model_shape(pack, drafts_from_own_mtp(pack, speculative)), drafts_from_head(speculative))
    return make_plan(mem, shape, request, settings)


def log_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

