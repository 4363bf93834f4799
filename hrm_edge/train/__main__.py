"""`python -m hrm_edge.train` (hrm_edge.train.loop)."""
from hrm_edge.errors import run_cli
from hrm_edge.train.loop import main

run_cli(main)
