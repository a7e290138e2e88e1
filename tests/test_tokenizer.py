"""tokenizer.py on the real tokenizer files in ../shared/data."""

import pytest
from conftest import SHARED, shared_file

from model import ConfigError
from tokenizer import SentencePieceTokenizer, TiktokenTokenizer, load_tokenizer

TOK = SHARED / "tokenizers"


def test_tok512_published_ids():
    tok = load_tokenizer(shared_file(TOK / "tok512.model"))
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tok.stop_ids == (2,) and tok.vocab_size == 512


def test_llama3_tiktoken_ids_and_specials():
    tok = load_tokenizer(shared_file(TOK / "llama3_tokenizer.model"))
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.encode("Hello world") == [128000, 9906, 1917]
    assert tok.vocab_size == 128256 and tok.stop_ids == (128001, 128009)
    assert tok.special["<|start_header_id|>"] == 128006
    assert tok.special["<|reserved_special_token_247|>"] == 128255
    # user text that looks like a special token stays plain text
    assert 128009 not in tok.encode("<|eot_id|>", bos=False)
    text = "Numbers 12345 and  spaces\n\nnew-lines, 'quotes' don't"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_chat("hi") == [128000, 128006, 882, 128007, 271, 6151, 128009, 128006,
                                     78191, 128007, 271]


@pytest.mark.parametrize("name,vocab", [("llama2_tokenizer.model", 32000),
                                        ("mistral_v1_tokenizer.model", 32000),
                                        ("mistral_v3_tokenizer.model", 32768)])
def test_sentencepiece_models(name, vocab):
    tok = load_tokenizer(shared_file(TOK / name))
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == vocab
    ids = tok.encode("The best thing to do in San Francisco")
    assert ids[0] == 1 and tok.decode(ids[1:]) == "The best thing to do in San Francisco"
    assert tok.decode(tok.encode_chat("hi")) == "[INST] hi [/INST]"


def test_chosen_by_content_not_name(tmp_path):
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").write_bytes(
        shared_file(TOK / "llama3_tokenizer.model").read_bytes())
    assert isinstance(load_tokenizer(tmp_path), TiktokenTokenizer)
    (tmp_path / "tokenizer.model").write_bytes((TOK / "tok512.model").read_bytes())
    assert isinstance(load_tokenizer(tmp_path), SentencePieceTokenizer)


def test_errors(tmp_path):
    with pytest.raises(ConfigError, match="no tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00garbage")
    with pytest.raises(ConfigError, match="cannot read tokenizer"):
        load_tokenizer(tmp_path)
