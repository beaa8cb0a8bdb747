"""Export a drafter to the directory layouts SGLang and vLLM serve (see export/formats.py)."""
