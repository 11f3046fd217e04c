"""Each token's bytes, as logprobs report them: the tokens of a text, their bytes put back
together, are that text's UTF-8 even where a token holds only part of a character."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conveyor.engine.sample.token_pieces import TokenPieces, byte_level_alphabet
from conveyor.testing.tiny_models import build_tokenizer

TEXT = "Tea for two 🍕 at the café ☃ — 日本語 done"


def test_the_byte_level_alphabet_covers_every_byte_once() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert (alphabet["Ġ"], alphabet["Ċ"], alphabet["A"], alphabet["é"]) == (ord(" "), ord("\n"), ord("A"), 0xE9)


def test_byte_level_tokens_give_back_the_texts_bytes(tmp_path) -> None:
    tok = build_tokenizer(tmp_path, family="qwen2")  # byte-level BPE trained on ASCII: other text splits into bytes
    pieces = TokenPieces(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in pieces.text_of(i)]
    assert partial, "the text should have tokens holding part of a character"
    assert b"".join(pieces.bytes_of(i) for i in ids) == TEXT.encode("utf-8")
    assert all(pieces.bytes_of(i) != "\ufffd".encode() for i in partial)


def test_sentencepiece_byte_fallback_pieces_are_their_bytes() -> None:
    vocab = {"<unk>": 0, "▁Tea": 1, "▁for": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    model = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    raw = Tokenizer(model)
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    pieces = TokenPieces(tok)
    assert not pieces.byte_level
    snow = "☃".encode()
    ids = [1, 2, *(3 + b for b in snow)]
    assert [pieces.bytes_of(i) for i in ids[2:]] == [bytes([b]) for b in snow]
    assert pieces.bytes_of(1) == pieces.text_of(1).encode() and pieces.text_of(1).endswith("Tea")  # a whole word
    assert b"".join(pieces.bytes_of(i) for i in ids[2:]).decode() == "☃"


def test_whole_tokens_are_their_text_encoded(tmp_path) -> None:
    tok = build_tokenizer(tmp_path, family="qwen2")
    pieces = TokenPieces(tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*tok.encode("The waiter pours cold water", add_special_tokens=False), end]
    assert [pieces.bytes_of(i) for i in ids] == [pieces.text_of(i).encode("utf-8") for i in ids]
    assert pieces.bytes_of(ids[-1]) == b"<|im_end|>"
