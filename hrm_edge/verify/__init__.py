"""Verification: the parity gate (hrm_edge.verify.parity: the runtime side, numpy and the runtimes only; its eager
reference in hrm_edge.verify.reference), the browser's parity bundle, ARM64 emulation (arm64_toolchain fetches it,
arm64_worker runs inside it, arm64_gate drives it), and the Debian packages the test suite needs."""
