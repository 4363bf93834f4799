"""`python -m hrm_edge.demo`: serves the phone-browser demo (hrm_edge.app.demo)."""
from hrm_edge.errors import run_cli
from hrm_edge.app.demo import main

if __name__ == "__main__":
    run_cli(main)
