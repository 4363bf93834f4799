"""`python -m hrm_edge.bench`: speed tables of an export folder (hrm_edge.measure.bench)."""
from hrm_edge.errors import run_cli
from hrm_edge.measure.bench import main

if __name__ == "__main__":
    run_cli(main)
