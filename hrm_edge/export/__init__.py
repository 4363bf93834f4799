"""Export: calibration, int8 quantization, the ONNX Loop graphs and the ExecuTorch programs, and the pipeline that
builds, gates and publishes an export folder (`python -m hrm_edge.export`)."""
