"""A token's own bytes (OpenAI's chat logprobs `bytes`), read from its vocabulary piece, for the two
spellings of bytes tokenizers use; the byte-level one is checked end to end in test_server_openai.py."""
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from treeserve.engine.token_bytes import TokenBytes
from treeserve.model.random_models import train_tokenizer


def test_a_byte_level_tokenizers_pieces_are_its_bytes():
    tokenizer = train_tokenizer()
    token_bytes = TokenBytes(tokenizer)
    text = "h\u00e9llo \U0001F600"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # (pieces of characters)
    assert b"".join(token_bytes(i) for i in ids) == text.encode("utf-8")
    assert token_bytes(tokenizer.eos_token_id) == b"<|eos|>"  # an added token is its text


def test_sentencepieces_byte_fallback_and_spaces():
    """Llama 2 / Mistral style: "\u2581" is a space, <0xNN> one byte, both ordinary vocabulary entries."""
    vocab = {"<unk>": 0, "<s>": 1, "\u2581hello": 2, "w": 3} | {f"<0x{b:02X}>": 4 + b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>")
    token_bytes = TokenBytes(tokenizer)
    pieces = [2, 3, 4 + 0xC3, 4 + 0xB6]  # " hello", "w", and the two bytes of "\u00f6"
    assert b"".join(token_bytes(i) for i in pieces) == " hellow\u00f6".encode("utf-8")
    assert token_bytes(1) == b"<s>"


def test_the_byte_level_alphabet_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from treeserve.engine.token_bytes import byte_level_alphabet

    assert byte_level_alphabet() == {ch: b for b, ch in bytes_to_unicode().items()}
