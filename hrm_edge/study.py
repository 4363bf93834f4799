"""`python -m hrm_edge.study`: the training-recipe study (hrm_edge.measure.study)."""
from hrm_edge.errors import run_cli
from hrm_edge.measure.study import main

if __name__ == "__main__":
    run_cli(main)
