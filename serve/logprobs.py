"""OpenAI's log-probability objects, from the engine's per-token entries (token id,
log-probability, [(id, log-probability)] of the most likely tokens; `serve.engine.Event.logprobs`).

Completions: {"tokens", "token_logprobs", "top_logprobs" (a dict per token: the most likely
tokens' texts and the drawn token's), "text_offset"}; with `echo` the prompt's tokens come first,
the very first one with null log-probabilities (vLLM's shape); chat: {"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}. vLLM's `prompt_logprobs`:
[null, {token id: {"logprob", "decoded_token"}} per later prompt token]. A token's text is its own
decoding.
"""

from __future__ import annotations


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, entries: list, text_offset: int) -> dict:
    """The completions `logprobs` object of `entries`, the first token's text at `text_offset`."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, logprob, top in entries:
        text = token_text(tokenizer, token)
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(None if logprob is None else
                            {**{token_text(tokenizer, i): value for i, value in top}, text: logprob})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top_logprobs}


def chat_logprobs(tokenizer, entries: list) -> dict:
    """The chat `logprobs` object ({"content": [...]}) of `entries`."""
    def item(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(token, logprob), "top_logprobs": [item(i, value) for i, value in top]}
                        for token, logprob, top in entries]}


def vllm_prompt_logprobs(tokenizer, entries: list) -> list:
    """vLLM's `prompt_logprobs` list of prompt `entries` (the first one's log-probability None)."""
    def item(token_id: int, logprob: float) -> dict:
        return {"logprob": logprob, "decoded_token": token_text(tokenizer, token_id)}

    return [None if logprob is None else {**{str(i): item(i, value) for i, value in top}, str(token): item(token, logprob)}
            for token, logprob, top in entries]
