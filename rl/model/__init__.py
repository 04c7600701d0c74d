"""The policy model: loading, building, and its log-probabilities.

`policy` loads a Hugging Face causal LM and its tokenizer from a local folder (or builds a tiny
one), `models` builds small real checkpoints and tokenizers here, `alphabet` is the tiny
model's vocabulary from the run's domains, and `logprobs` the chunked token log-probabilities
and entropy that sampling, the reference model and the losses all use.
"""
