"""vLLM's `bad_words` and `allowed_token_ids`: tokens masked out of a row's logits before sampling.

`allowed_token_ids` masks every other token: a request's mask is built once, on the logits' device,
and kept with the runner's state of the request. `bad_words` are token sequences (each word as the
tokenizer writes it alone and after a space, as vLLM's `update_from_tokenizer`); a sequence's last
token is masked when the tokens before it end the request's output so far (its generated tokens,
not the prompt, as vLLM's). Only rows that ask for either pay anything: the runner's batch counts
them (`InputBatch.num_masked`), so a step with none skips this module.
"""
from __future__ import annotations

import torch

from treeserve.errors import ParamError
from treeserve.model.transfer import to_device

MAX_BAD_WORD_SEQUENCES = 128  # (vLLM's VLLM_MAX_NUM_BAD_WORDS default)


def bad_word_sequences(tokenizer, words: list[str], vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids as written alone, and after a space where that gives a new word token
    of the same length (vLLM's rule: "foo" and " foo" are different tokens in most vocabularies)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not alone:
            raise ParamError("bad_words", f"{word!r} is no token at all in this model's vocabulary")
        sequences.append(alone)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORD_SEQUENCES:
        raise ParamError("bad_words", f"too many: {len(sequences)} token sequences, at most {MAX_BAD_WORD_SEQUENCES}")
    outside = sorted({t for seq in sequences for t in seq if not 0 <= t < vocab_size})
    if outside:
        raise ParamError("bad_words", f"token ids {outside} are outside the vocabulary [0, {vocab_size})")
    return tuple(sequences)


def banned_tokens(output_token_ids: list[int], sequences: tuple[tuple[int, ...], ...]) -> list[int]:
    """The last token of each sequence whose other tokens end the output so far."""
    banned = []
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix <= len(output_token_ids) and (prefix == 0 or output_token_ids[-prefix:] == list(seq[:-1])):
            banned.append(seq[-1])
    return banned


def recent_output(request, sequences: tuple[tuple[int, ...], ...]) -> list[int]:
    """The end of the row's output that `sequences`' prefixes may match (the longest prefix's length),
    read without copying the rest (a verified row's output is its request's and the drafts before it:
    copying that whole history for each of a step's rows cost milliseconds)."""
    return request.recent_output(max(len(seq) for seq in sequences) - 1)


def check_something_is_left(params, bad_words_sequences, eos_token_ids) -> None:
    """ParamError unless `allowed_token_ids` leave a token to sample: one that no one-token bad word
    bans, and, with `min_tokens`, one that does not stop the sequence (the sampler masks those until
    min_tokens). Otherwise every logit of the row would be -inf and a token outside the set come out."""
    if not params.allowed_token_ids:
        return
    left = set(params.allowed_token_ids) - {seq[0] for seq in bad_words_sequences if len(seq) == 1}
    if not left:
        raise ParamError("allowed_token_ids", "every allowed token is one of bad_words: nothing could be sampled")
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    if params.min_tokens and not left - stops:
        raise ParamError("allowed_token_ids", f"every allowed token stops the sequence (EOS or stop_token_ids), "
                         f"which min_tokens={params.min_tokens} forbids first: nothing could be sampled")


def uses_token_masks(params) -> bool:
    return bool(params.allowed_token_ids or params.bad_words_token_ids)


def disallowed_mask(allowed_token_ids: list[int], vocab: int, device) -> torch.Tensor:
    """[vocab] bool, True for every token `allowed_token_ids` leaves out."""
    mask = torch.ones(vocab, dtype=torch.bool)
    mask[torch.tensor(allowed_token_ids, dtype=torch.long)] = False
    return to_device(mask, device)


def apply_token_masks(logits: torch.Tensor, requests) -> None:
    """Masks, in place, what each row's `allowed_token_ids` leaves out and the `bad_words` tokens it
    may not sample next (every row's at once: a verified request has k + 1 rows)."""
    vocab, minus_inf = logits.shape[1], float("-inf")
    rows: list[int] = []
    banned: list[int] = []
    for row, request in enumerate(requests):
        params = request.sampling_params
        if params.allowed_token_ids:
            logits[row].masked_fill_(_disallowed(request, vocab, logits.device), minus_inf)
        if params.bad_words_token_ids:
            tokens = banned_tokens(recent_output(request, params.bad_words_token_ids), params.bad_words_token_ids)
            rows += [row] * len(tokens)
            banned += tokens
    if banned:  # (the value filled on the device, not copied there: a copy from pageable memory waits for it)
        index = to_device(torch.tensor([rows, banned]), logits.device)
        logits.index_put_((index[0], index[1]), logits.new_full((), minus_inf))


def _disallowed(request, vocab: int, device) -> torch.Tensor:
    """The request's mask, built at its first step and kept with it (`CachedRequestState.allowed_mask`)."""
    mask = getattr(request, "allowed_mask", None)
    if mask is None or mask.shape[0] != vocab:
        mask = request.allowed_mask = disallowed_mask(request.sampling_params.allowed_token_ids, vocab, device)
    return mask
