"""`python -m hrm_edge.peers`: builds and times each runtime's own Llama (hrm_edge.measure.peers)."""
from hrm_edge.errors import run_cli
from hrm_edge.measure.peers import main

if __name__ == "__main__":
    run_cli(main)
