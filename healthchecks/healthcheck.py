#!/usr/bin/env python3
"""Docker's HEALTHCHECK for the appliance: `healthcheck.py liveness|readiness`, exit 0 healthy, 1 unhealthy.

The checks are role-aware (single/head: HTTP /health and /v1/models; worker: its process and its connection to
the head's rendezvous) and live in vllm_exl3/appliance/health.py, which imports only the standard library.
"""

import sys

from vllm_exl3.appliance.health import main

sys.exit(main(sys.argv))
