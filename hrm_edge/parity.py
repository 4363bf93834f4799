"""`python -m hrm_edge.parity`: re-verifies an export folder, on this CPU (hrm_edge.verify.parity) or on emulated
ARM64 (--target aarch64: hrm_edge.verify.arm64_gate, which builds on the host gate; the host gate never imports it)."""
from hrm_edge.errors import run_cli
from hrm_edge.verify.arm64_gate import target_main
from hrm_edge.verify.parity import main

if __name__ == "__main__":
    run_cli(lambda argv: main(argv, target_main=target_main))
