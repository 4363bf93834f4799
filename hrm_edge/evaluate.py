"""`python -m hrm_edge.evaluate`: held-out bits per byte and completions (hrm_edge.measure.evaluate)."""
from hrm_edge.errors import run_cli
from hrm_edge.measure.evaluate import main

if __name__ == "__main__":
    run_cli(main)
