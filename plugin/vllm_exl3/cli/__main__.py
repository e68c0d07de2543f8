"""`python -m vllm_exl3.cli ARGS` = `vllm-exl3 ARGS`."""

import sys

from .main import main

sys.exit(main())
