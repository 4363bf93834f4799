"""What users run on exported programs: streaming completion (`python -m hrm_edge.complete`) and the phone-browser
demo (`python -m hrm_edge.demo`, the page in web/)."""
