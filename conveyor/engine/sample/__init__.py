"""Choosing the next tokens from the logits: the sampler (temperature, top-k/p, min-p, penalties,
logit bias, seeds), logprobs and each prompt token's logprob, and a token's text for them."""
