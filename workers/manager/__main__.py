"""`python -m loomllm.workers.manager ...`: the daemon's command line (engine-manager)."""

from loomllm.workers.manager.cli import main

main()
