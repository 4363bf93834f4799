"""`python -m hrm_edge.corpus`: builds the pinned PyPI training corpus (hrm_edge.train.corpus)."""
from hrm_edge.errors import run_cli
from hrm_edge.train.corpus import main

if __name__ == "__main__":
    run_cli(main)
