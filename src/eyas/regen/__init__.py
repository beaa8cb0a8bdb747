"""Regenerate training answers with the target itself (`eyas regenerate`).

sampling.py   greedy / counter-based reproducible sampling shared by every local engine
static_lm.py  static-KV-cache forward over a Hugging Face Llama/Qwen model's own modules
attention.py  decode attention over each row's own keys (Triton kernel; SDPA reference), packed prefill
local.py      in-process engines: StaticEngine (CUDA graphs, continuous refill) and generate
server.py     OpenAI-compatible servers: concurrency, retries, failure reasons
driver.py     turn-by-turn conversations over any engine
output.py     chats.jsonl + meta.json with chunked atomic commits and exact resume
run.py        RegenConfig and `regenerate(config)`, the command's body
"""
