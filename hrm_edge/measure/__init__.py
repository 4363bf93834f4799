"""Measurement: one timing harness (fresh process per program, warm-up, medians, peak RSS, the CPU) serving the
speed bench, the runtimes' own Llama peers, the study, and the held-out evaluation."""
