"""tokenizer.py on the real tokenizer files in ../shared/data.

References: SentencePiece and tiktoken for their own files; transformers (its GGUF tokenizer, and
``AutoTokenizer`` on what ``HFTokenizer.save`` writes) for the Hugging Face and GGUF tokenizers;
llama.cpp's pre-tokenizer regexes, applied in Python, for the GGUF pre-tokenizers.
"""

import json
import unicodedata

import pytest
from conftest import SHARED, shared_file

from rocketkv.formats.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    gguf_tokenizer,
    has_tokenizer,
    load_tokenizer,
)
from rocketkv.model import ConfigError

TOK = SHARED / "tokenizers"
MODELS = SHARED / "models"
SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello world", "The best thing to do in San Francisco", "12345", " 2024",
    "In 2024, pi was 3.14159 and 1,000,000 people said ½ or ²; ٣ is three",
    "def add(a, b):\n    return a + b\n\n\nclass X:\n\tpass\n", "naïve café — Ωμέγα Привет",
    "中文测试，日本語のテキスト、한국어", "emoji 😀🎉 👍🏽 and ‍🚀", "  two leading", "trailing  ",
    "a  b   c    d", "line\n\nbreaks\r\nand\ttabs", "it's don't we'll I'M THEY'RE", "", " ", "\n",
    "<|im_start|>user\nhi<|im_end|>", "x  12 y", "\n\n2024", "a    1", "$x^2 + y_{ij}$ <= 10!",
]


def apply_ids(out) -> list[int]:
    """Token ids from transformers' apply_chat_template(tokenize=True): a list, or (in
    transformers 5) a BatchEncoding/dict holding them."""
    if isinstance(out, list):
        return out
    return list(out["input_ids"])


# --- existing SentencePiece / tiktoken behaviour ------------------------------------------------

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


# --- fallback chat templates ---------------------------------------------------------------------

def test_llama3_fallback_template_with_system():
    tok = load_tokenizer(shared_file(TOK / "llama3_tokenizer.model"))
    text = tok.render_chat("hi", system="Be brief.")
    # Meta's Llama 3 header format, spelled out by hand
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief."
                    "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    s = tok.special
    assert tok.encode_chat("hi", system="Be brief.") == (
        [128000, s["<|start_header_id|>"], *tok.encode("system", bos=False),
         s["<|end_header_id|>"], *tok.encode("\n\nBe brief.", bos=False), s["<|eot_id|>"]]
        + tok.encode_chat("hi")[1:])
    assert tok.chat_stop_ids == (128001, 128009)


def test_llama2_fallback_template():
    tok = load_tokenizer(shared_file(TOK / "llama2_tokenizer.model"))
    assert tok.render_chat("hi", system="Be brief.") == (
        "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nhi [/INST]")
    assert tok.encode_chat("hi", system="Be brief.") == (
        [1] + tok.sp.encode("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nhi [/INST]"))
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "user", "content": "c"}]
    text = tok.apply_chat_template(turns)
    assert text == "[INST] a [/INST] b </s><s>[INST] c [/INST]"
    # '</s>' and '<s>' in rendered text are the EOS/BOS ids, the rest is SentencePiece's
    sp = tok.sp
    assert tok.encode_special(text) == (sp.encode("[INST] a [/INST] b ") + [2, 1]
                                        + sp.encode("[INST] c [/INST]"))
    assert tok.chat_stop_ids == (2,)


# --- GGUF: SmolLM2 (byte-level BPE, pre-tokenizer 'smollm') against transformers ------------------

@pytest.fixture(scope="session")
def smol() -> HFTokenizer:
    return gguf_tokenizer(shared_file(MODELS / SMOL))


@pytest.fixture(scope="session")
def smol_ref():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(shared_file(MODELS)), gguf_file=SMOL)


def _split_n(text: str) -> list[str]:
    """llama.cpp's first 'smollm' split (regex \\p{N}): each number character alone."""
    pieces, run = [], ""
    for ch in text:
        if unicodedata.category(ch).startswith("N"):
            pieces += [run, ch] if run else [ch]
            run = ""
        else:
            run += ch
    return pieces + ([run] if run else [])


def _digit_split_matters(text: str) -> bool:
    """Whether transformers' GGUF tokenizer (no digit split) may differ from llama.cpp on
    ``text``: whitespace before a number character other than an ASCII digit (SmolLM2 has merges
    such as 'Ġ½', none joining 'Ġ' and an ASCII digit), or 2+ whitespace characters before a
    digit (llama.cpp keeps the run whole: 'ĠĠ', '1' where transformers gives 'Ġ', 'Ġ1')."""
    for i, ch in enumerate(text):
        if i and text[i - 1].isspace() and unicodedata.category(ch).startswith("N"):
            if ch not in "0123456789" or (i > 1 and text[i - 2].isspace()):
                return True
    return False


def test_smollm_gguf_metadata(smol):
    path = MODELS / SMOL
    assert has_tokenizer(path)
    assert smol.vocab_size == 49152 and smol.bos_id == 1 and smol.bos_token == "<|im_start|>"
    assert smol.add_bos is False and smol.stop_ids == (2,) and smol.eos_token == "<|im_end|>"
    assert smol.chat_template.startswith("{% for message in messages %}")
    assert smol.encode("Hello") == smol.encode("Hello", bos=False)  # add_bos false: no BOS


def test_smollm_gguf_ids_match_transformers(smol, smol_ref):
    # llama.cpp ('smollm') splits every number character off first, then applies the GPT-2
    # regex; so does SmolLM2's own tokenizer.json. transformers' GGUF loader skips the digit
    # split: the reference is transformers on each piece of that split, and transformers on the
    # whole text where the split cannot matter.
    checked = 0
    for text in TEXTS:
        ids = smol.encode(text)
        split_ref = [i for piece in _split_n(text) for i in smol_ref.encode(piece)]
        assert ids == split_ref, text
        if not _digit_split_matters(text):
            assert ids == smol_ref.encode(text), text
            checked += 1
        assert smol.decode(ids) == smol_ref.decode(ids, skip_special_tokens=True), text
    assert checked >= len(TEXTS) - 4
    assert smol.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1  # special text is the token
    assert [smol.tok.id_to_token(i) for i in smol.encode("x  12 y")] == [
        "x", "ĠĠ", "1", "2", "Ġy"]


def test_smollm_gguf_chat_matches_transformers(smol, smol_ref):
    for system in (None, "You answer in one word."):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": "What is 2+2?"}]
        text = smol_ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert smol.render_chat("What is 2+2?", system=system) == text
        ids = apply_ids(smol_ref.apply_chat_template(messages, tokenize=True,
                                                     add_generation_prompt=True))
        assert smol.encode_chat("What is 2+2?", system=system) == ids
    assert 2 in smol.chat_stop_ids


# --- GGUF pre-tokenizers against llama.cpp's regexes ---------------------------------------------

LLAMA_CPP_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA_CPP_REGEXES = {  # llama.cpp's llm_tokenizer_bpe regex lists, applied one after the other
    "smollm": [r"\p{N}", LLAMA_CPP_GPT2],
    "gpt-2": [LLAMA_CPP_GPT2],
    "llama-bpe": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?"
                  r"\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", LLAMA_CPP_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "qwen2": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?"
              r"\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}


def _byte_level(text: str) -> str:
    """GPT-2's bytes-to-unicode spelling of ``text``'s UTF-8 bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return "".join(table[b] for b in text.encode("utf-8"))


def llama_cpp_split(text: str, patterns: list[str]) -> list[str]:
    regex = pytest.importorskip("regex")
    pieces = [text] if text else []
    for pattern in patterns:
        out = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(pattern, piece):
                if m.start() > pos:
                    out.append(piece[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(piece):
                out.append(piece[pos:])
        pieces = out
    return pieces


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP_REGEXES))
def test_gguf_pre_tokenizers_follow_llama_cpp(pre):
    from rocketkv.formats.tokenizer import _bpe_pre_tokenizer

    pre_tokenizer = _bpe_pre_tokenizer(pre)
    for text in TEXTS + ["Hello, World!!! ($5.99) x=1234567 <a href='b'>", "I'VE  'll\r\n\r\n x"]:
        got = [p for p, _ in pre_tokenizer.pre_tokenize_str(text)]
        want = [_byte_level(p) for p in llama_cpp_split(text, LLAMA_CPP_REGEXES[pre])]
        assert got == want, (pre, text)


# --- GGUF: SentencePiece ('llama') against sentencepiece ----------------------------------------

def write_gguf(path, model=None, tokens=None, **fields):
    """A tokenizer-only GGUF (no tensors) with the given tokenizer metadata."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    if model is not None:
        w.add_tokenizer_model(model)
    if tokens is not None:
        w.add_token_list(tokens)
    adders = {"scores": w.add_token_scores, "types": w.add_token_types,
              "merges": w.add_token_merges, "pre": w.add_tokenizer_pre,
              "bos": w.add_bos_token_id, "eos": w.add_eos_token_id, "unk": w.add_unk_token_id,
              "add_bos": w.add_add_bos_token, "template": w.add_chat_template}
    for key, value in fields.items():
        adders[key](value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def llama2_sp():
    spm = pytest.importorskip("sentencepiece")
    return spm.SentencePieceProcessor(model_file=str(shared_file(TOK / "llama2_tokenizer.model")))


@pytest.fixture(scope="session")
def llama2_gguf(tmp_path_factory, llama2_sp):
    """Llama 2's SentencePiece vocabulary as llama.cpp's converter writes it into a GGUF."""
    sp = llama2_sp
    n = sp.vocab_size()
    types = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i)
             else 5 if sp.is_unused(i) else 1 for i in range(n)]
    return write_gguf(tmp_path_factory.mktemp("gguf") / "llama2-tokenizer.gguf", "llama",
                      [sp.id_to_piece(i) for i in range(n)],
                      scores=[sp.get_score(i) for i in range(n)], types=types,
                      bos=sp.bos_id(), eos=sp.eos_id(), unk=sp.unk_id())


@pytest.fixture(scope="session")
def llama2_gguf_tok(llama2_gguf) -> HFTokenizer:
    return load_tokenizer(llama2_gguf)


def test_llama_gguf_matches_sentencepiece(llama2_gguf_tok, llama2_sp):
    tok, sp = llama2_gguf_tok, llama2_sp
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 32000
    assert tok.bos_id == 1 and tok.add_bos and tok.stop_ids == (2,)
    texts = TEXTS + ["x" + " " * k + "y" for k in range(1, 20)] + [" " * k for k in range(1, 20)]
    for text in texts:
        ids = tok.encode(text)
        assert ids == [1] + sp.encode(text), text
        assert tok.encode(text, bos=False) == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids) == text, text


def test_llama_gguf_defaults(tmp_path):
    # no special ids, no add_bos/add_space_prefix fields: llama.cpp's defaults (BOS 1 added, EOS
    # 2, unknown 0, a space prefix)
    path = write_gguf(tmp_path / "spm.gguf", "llama",
                      ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "▁ab"],
                      scores=[0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0],
                      types=[2, 3, 3, 1, 1, 1, 1, 1])
    tok = load_tokenizer(path)
    assert (tok.bos_id, tok.stop_ids, tok.add_bos) == (1, (2,), True)
    assert tok.encode("ab") == [1, 7] and tok.encode("ba", bos=False) == [3, 5, 4]
    assert tok.encode("c", bos=False) == [3, 0]  # no byte pieces to fall back to: unknown
    assert tok.decode([1, 7, 3, 5, 2]) == "ab b"


def test_llama_gguf_without_template_has_no_chat(llama2_gguf_tok):
    assert llama2_gguf_tok.chat_template is None
    with pytest.raises(ConfigError, match="no chat template"):
        llama2_gguf_tok.render_chat("hi")
    with pytest.raises(ConfigError, match="no chat template"):
        llama2_gguf_tok.encode_chat("hi")
    assert llama2_gguf_tok.chat_stop_ids == llama2_gguf_tok.stop_ids


# --- tokenizer.json: save, AutoTokenizer, from_file ----------------------------------------------

@pytest.mark.parametrize("which", ["smol", "llama2_gguf_tok"])
def test_save_round_trip_through_transformers(which, request, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = request.getfixturevalue(which)
    written = tok.save(tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "tokenizer.json", "tokenizer_config.json"] == sorted(p.name for p in written)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    if tok.chat_template is not None:
        messages = [{"role": "user", "content": "Name 3 colors."}]
        assert tok.render_chat("Name 3 colors.") == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
        assert tok.encode_chat("Name 3 colors.") == apply_ids(ref.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True))
    again = load_tokenizer(tmp_path / "hf")
    assert isinstance(again, HFTokenizer)
    assert (again.bos_id, again.add_bos, again.stop_ids, again.chat_template, again.vocab_size
            ) == (tok.bos_id, tok.add_bos, tok.stop_ids, tok.chat_template, tok.vocab_size)
    assert all(again.encode(t) == tok.encode(t) for t in TEXTS)


def tiny_tokenizer_dir(path, **config):
    """A word-level tokenizer.json with a few special tokens, and the given config files
    (``tokenizer_config``, ``generation_config``, ``config`` dicts; ``jinja`` text)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|eot|>": 3, "hi": 4, "there": 5, "<|end|>": 6,
             "<|end_turn|>": 7, "user": 8, "assistant": 9}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in ("<unk>", "<s>", "</s>", "<|eot|>", "<|end|>",
                                      "<|end_turn|>")])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    for name in ("tokenizer_config", "generation_config", "config"):
        if name in config:
            (path / f"{name}.json").write_text(json.dumps(config[name]))
    if "jinja" in config:
        (path / "chat_template.jinja").write_text(config["jinja"])
    return path


TURN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <|end_turn|> "
                 "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")


def test_tokenizer_json_config_files(tmp_path):
    folder = tiny_tokenizer_dir(
        tmp_path, generation_config={"eos_token_id": [3, 2]}, config={"eos_token_id": 6},
        tokenizer_config={"bos_token": "<s>", "add_bos_token": True,
                          "eos_token": {"__type": "AddedToken", "content": "</s>"},
                          "chat_template": [{"name": "tool_use", "template": "tools"},
                                            {"name": "default", "template": TURN_TEMPLATE}]})
    tok = load_tokenizer(folder)
    assert isinstance(tok, HFTokenizer) and has_tokenizer(folder)
    assert tok.stop_ids == (3, 2, 6)  # generation_config list, then eos_token, then config.json
    assert tok.eos_token == "</s>" and tok.bos_id == 1 and tok.vocab_size == 10
    # add_bos_token in tokenizer_config.json makes the post-processor add BOS
    assert tok.add_bos and tok.encode("hi there") == [1, 4, 5]
    assert tok.encode("hi there", bos=False) == [4, 5]
    assert tok.render_chat("hi") == "user hi <|end_turn|> assistant "
    assert tok.encode_chat("hi") == [8, 4, 7, 9]
    assert tok.chat_stop_ids == (3, 2, 6, 7)
    assert tok.decode([1, 4, 3, 5, 2]) == "hi there"
    # a tokenizer.json under another name is still read by content
    (tmp_path / "renamed").mkdir()
    (tmp_path / "renamed" / "tokenizer.model").write_bytes((folder / "tokenizer.json").read_bytes())
    renamed = load_tokenizer(tmp_path / "renamed")
    assert isinstance(renamed, HFTokenizer) and renamed.encode("hi there") == [4, 5]


def test_chat_template_jinja_file_as_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = tiny_tokenizer_dir(tmp_path, jinja=TURN_TEMPLATE,
                                tokenizer_config={"eos_token": "</s>", "chat_template": "other"})
    tok = load_tokenizer(folder)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "system", "content": "there"}, {"role": "user", "content": "hi"}]
    assert tok.render_chat("hi", system="there") == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True) == (
        "system there <|end_turn|> user hi <|end_turn|> assistant ")


def test_bad_chat_templates(tmp_path):
    folder = tiny_tokenizer_dir(tmp_path, tokenizer_config={"eos_token": "</s>"})
    tok = load_tokenizer(folder)
    with pytest.raises(ConfigError, match="no chat template"):
        tok.render_chat("hi")
    assert tok.chat_stop_ids == (2,)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }"
    with pytest.raises(ConfigError, match="syntax error"):
        tok.render_chat("hi")
    tok.chat_template = "{{ raise_exception('only user turns are supported') }}"
    with pytest.raises(ConfigError, match="only user turns are supported"):
        tok.render_chat("hi")
    tok.chat_template = "{{ messages[0]['content'] | tojson }}{{ strftime_now('%Y')[:0] }}"
    assert tok.render_chat("naïve") == '"naïve"'
    tok.chat_template = "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}"
    assert tok.render_chat("hi") == "hi"
    tok.chat_template = "{{ messages[0].nothing.deeper }}"
    with pytest.raises(ConfigError, match="failed to render.*nothing"):
        tok.render_chat("hi")


# --- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("content", ["{not json", '{"model": 1}'])
def test_tokenizer_json_that_does_not_parse(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(ConfigError, match="cannot parse tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ConfigError, match="cannot parse tokenizer.json"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_bad_gguf_files(tmp_path):
    tokens = ["<|endoftext|>", "a", "b", "ab"]
    good = write_gguf(tmp_path / "good.gguf", "gpt2", tokens, types=[3, 1, 1, 1],
                      merges=["a b"], pre="gpt-2", eos=0)
    tok = load_tokenizer(good)
    assert tok.encode("abab<|endoftext|>") == [3, 3, 0] and tok.stop_ids == (0,)
    assert not tok.add_bos and tok.bos_id is None
    with pytest.raises(ConfigError, match="'bert'.*not supported"):
        load_tokenizer(write_gguf(tmp_path / "bert.gguf", "bert", tokens))
    with pytest.raises(ConfigError, match="'qwen35'.*supported: smollm"):
        load_tokenizer(write_gguf(tmp_path / "qwen.gguf", "gpt2", tokens, types=[3, 1, 1, 1],
                                  merges=["a b"], pre="qwen35"))
    none = write_gguf(tmp_path / "none.gguf")
    assert not has_tokenizer(none)  # a GGUF without tokenizer metadata has none
    with pytest.raises(ConfigError, match="has no tokenizer"):
        load_tokenizer(none)
    with pytest.raises(ConfigError, match="merge"):
        load_tokenizer(write_gguf(tmp_path / "merge.gguf", "gpt2", tokens, merges=["a c"]))
    (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[:100])
    assert has_tokenizer(tmp_path / "cut.gguf")  # so that loading it says what is wrong
    with pytest.raises(ConfigError, match="GGUF"):
        load_tokenizer(tmp_path / "cut.gguf")
    (tmp_path / "fake.gguf").write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ConfigError, match="not a GGUF file"):
        load_tokenizer(tmp_path / "fake.gguf")


def test_gguf_found_by_magic_not_name(tmp_path):
    path = write_gguf(tmp_path / "tokenizer.bin", "gpt2", ["a", "b", "ab", "<s>", "</s>"],
                      types=[1, 1, 1, 3, 3], merges=["a b"], pre="smollm", bos=3, add_bos=True,
                      template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}</s>"
                               "{% endfor %}")
    assert has_tokenizer(path) and not has_tokenizer(tmp_path)
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer) and tok.add_bos and tok.encode("ab") == [3, 2]
    assert tok.render_chat("ab") == "<s>ab</s>" and tok.encode_chat("ab") == [3, 2, 4]
    assert tok.stop_ids == () and tok.chat_stop_ids == (4,)
