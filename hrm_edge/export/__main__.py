"""`python -m hrm_edge.export` (hrm_edge.export.pipeline)."""
from hrm_edge.errors import run_cli
from hrm_edge.export.pipeline import main

run_cli(main)
