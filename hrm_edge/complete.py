"""`python -m hrm_edge.complete`: streams a completion from an export folder (hrm_edge.app.complete)."""
from hrm_edge.errors import run_cli
from hrm_edge.app.complete import main

if __name__ == "__main__":
    run_cli(main)
