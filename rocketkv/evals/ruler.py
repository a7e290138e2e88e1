"""RULER-style synthetic long-context tasks, generated deterministically by our own code, and
their prompts as the harness's items.

The tasks follow the definitions of NVIDIA's RULER benchmark (retrieval, multi-hop tracing and
aggregation), scaled to a small instruct model (SmolLM2-135M-Instruct, 8K context). They measure
how much of a long context a model (with a compressed KV cache) can still use.

    from rocketkv.evals.ruler import TASKS, load_essays, make_sample
    sample = make_sample("niah_single_essay", 4096, count_tokens, seed=0, essays=load_essays())

A ``Sample`` has the ``context`` (the document), the ``question`` asked after it, the
``answer_prefix`` the assistant's reply starts with, the expected ``outputs``, the ``depth`` of
the (first) needle and a sufficient ``max_new_tokens``. The evaluation puts context then question
in the user turn and starts the assistant turn with the answer prefix.

Tasks (keys are two random words joined by a hyphen, e.g. ``"harbor-velvet"``; numbers have 7
digits; all are drawn from the sample's random generator):

* ``niah_single_noise``: the haystack repeats the filler "The grass is green. The sky is blue.
  The sun is yellow. Here we go. There and back again."; one needle "One of the special magic
  numbers for {key} is: {number}." sits at a sentence boundary; the question asks for the number.
* ``niah_single_essay``: the same with essay sentences (``essays``) as the haystack, read from a
  random sentence on (wrapping around at the end of the text).
* ``niah_single_uuid``: essay haystack; the value is a UUID ("special magic uuids") drawn from
  the generator (``uuid.UUID(int=getrandbits(128), version=4)``, not ``uuid4()``).
* ``niah_multikey``: essay haystack with 4 needles of 4 different keys; one key is asked, the
  other 3 needles are distractors.
* ``niah_multivalue``: essay haystack with 4 needles of the same key and 4 different numbers; the
  question asks for all of them; all 4 are expected.
* ``niah_multiquery``: essay haystack with 4 needles of 4 keys; all 4 keys are asked in one
  question; all 4 numbers are expected.
* ``vt`` (variable tracking): noise haystack with a chain of 5 statements "VAR ABCDE = 12345.",
  "VAR FGHIJ = VAR ABCDE.", ... (5-letter upper-case names, a 5-digit value) inserted in order at
  increasing sentence boundaries; the question asks which variables are assigned the value; all
  5 names are expected.
* ``cwe`` (common words extraction): a numbered list "1. word" (one item a line) of real English
  words, shuffled: 10 common words appear ``f_c`` times each (``f_c`` = 35% of the estimated
  items / 10, kept in 3..30: 6 at 1K tokens, 23 at 4K and 30 from about 6K with SmolLM2's
  tokenizer), every other word at most ``f_r`` <= ``f_c`` / 2 times (``f_r`` = 1..3, more only
  when the pool of 590 words runs short: beyond about 8K tokens); all 10 common words are
  expected.
* ``fwe`` (frequent words extraction): space-separated made-up 6-letter words whose counts
  follow Zipf's law with exponent 2 (rank r occurs ``floor(N r**-2 / zeta(2))`` times, the words
  left over from the rounding occur once each under new ranks), shuffled; the 3 most frequent
  are expected (their counts are strictly above every other word's).

Needles (the needle tasks' facts, vt's statements) are sentences of their own at boundaries
between haystack sentences: a single needle at a boundary drawn uniformly from the generator;
several needles at distinct boundaries drawn uniformly (niah needles in random order, vt's
chain in order). ``depth`` is the fraction of the context's tokens before the first needle whose
value is expected (the asked one for niah_multikey; the first statement for vt), None for cwe
and fwe.

Length: ``count_tokens(context) <= context_tokens`` and at least ``context_tokens - max(16,
floor(2% of context_tokens))``. Haystacks are whole sentences (essay sentences that do not fit
the remaining room are skipped), lists are whole items. Sentences are counted one at a time and
summed; the whole context is then counted and sentences are dropped (or added) until it fits.
List tasks calibrate the tokens per item on a probe, then search the number of items on whole-
context counts (a few counts). Only ``count_tokens`` needs to be exact; ``len(text) // 4`` works
for trying things out.

Scoring (``score_task``, ``evals.scoring``): pass/fail on the first value the answer states
for the one-answer tasks (``PASS_FAIL_TASKS``: niah_single_*, niah_multikey), F1 of the
distinct values stated against the expected set for the others (multivalue, multiquery, vt,
cwe, fwe); values are whole numbers, UUIDs, names and words on boundaries, so "167921525" is
not 1679215 and listing guesses costs precision. Given ``capped`` (the answer stopped at its
token cap), a last value ending at the very end of the answer may be cut and is neither
right nor wrong (unless it is a number no expected value starts with; a one-answer task
left with no complete value scores None, left out of the means); given the item's
``facts``, niah_multiquery counts a value only under its own key (``evals.scoring``'s module
docstring has both rules). The harness records each answer's ``capped`` flag
(``harness.Answers``) and passes it to a score that takes it (``score_item``);
``rocketkv.evals.rescore`` rescores stored answers with both rules.
RULER's own ``string_match_all`` (``evals.metrics``: the fraction of the expected outputs
that occur in the prediction as substrings, ignoring case) is kept as the ``substring``
column for comparison; ``string_match_part`` is 1.0 when any of them occurs. Expected words
of cwe are chosen so that no pool word contains another and none occurs in the task's
question or answer prefix; fwe's words all have the same length.

Determinism: everything is drawn from ``random.Random(f"{task}:{seed}")`` (string seeds hash
with SHA-512, not Python's per-process hash), so the same arguments (and the same
``count_tokens`` and ``essays``) give an equal Sample and a different seed gives a different
one. No set is iterated. ``Sample.facts`` lists every key and value a sample drew.

As the harness's items (``build_items``, for ``scripts/eval_ruler.py``): for every task and
context length, sample j drawn with ``sample_seed(task, length, j, seed, split)`` (a SHA-256 of
them, ``evals.prompts.prompt_seed``; the ``dev`` split hashes another name), redrawn when a
fact repeats one drawn earlier in the grid, so no two prompts share a key, value or name;
the context gets ``length - (template + question)`` tokens, so a prompt holds about ``length``
tokens, in the chat template (``evals.harness.chat_pieces``). ``task_rows`` gives each result
row its per-task scores and their mean.
"""

from __future__ import annotations

import functools
import math
import random
import re
import string
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rocketkv.data import ESSAYS
from rocketkv.evals.harness import Item, chat_pieces
from rocketkv.evals.prompts import prompt_seed, read_texts, split_sentences
from rocketkv.evals.scoring import score_answer
from rocketkv.formats.tokenizer import Tokenizer
from rocketkv.model import ConfigError

CountTokens = Callable[[str], int]

TASKS: tuple[str, ...] = ("niah_single_noise", "niah_single_essay", "niah_single_uuid",
                          "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe",
                          "fwe")
ESSAY_TASKS: tuple[str, ...] = ("niah_single_essay", "niah_single_uuid", "niah_multikey",
                                "niah_multivalue", "niah_multiquery")

NOISE_SENTENCES: tuple[str, ...] = ("The grass is green.", "The sky is blue.",
                                    "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "One of the special magic {kinds} for {key} is: {value}."
NUM_NEEDLES = 4  # niah_multikey / multivalue / multiquery
VT_HOPS = 4  # statements after the first: 5 variables
CWE_COMMON = 10
CWE_MAX_FREQ = 30
FWE_ALPHA = 2.0
FWE_TOP = 3
_FWE_ZETA = math.pi ** 2 / 6  # zeta(FWE_ALPHA): the Zipf normaliser for FWE_ALPHA = 2
# Answer caps in tokens. In the Qwen2.5-Coder-0.5B RULER runs at 4K-32K
# (results/accuracy/qwen2.5-coder-0.5b-rerun, Qwen's tokenizer), 317 of 395 niah_multivalue and
# 351 of 395 niah_multiquery answers reached their cap of 64 (189 and 194 ending in a digit: a
# number cut mid-way); 31 and 51 of the capped ones were still listing right values when the
# cap cut them before the fourth (an answer that glosses each value, "1. 3310752: Lisp is ...",
# takes 20+ tokens a value, a keyed line "1. broom-nugget: 4784516" 17); complete answers
# stating all four took up to 55. 128 would hold four keyed values; the caps stay 64 while every
# published cell was made at 64 (a cell at another cap would not compare), and stored answers
# are rescored with the cut rule instead (``evals.rescore``). vt (48), cwe (96) and fwe (40):
# complete answers took at most 30, about 26 and 17 tokens; their capped answers are loops.
# Each item asks for its task's cap (build_items: meta["max_new_tokens"]).
MAX_NEW_TOKENS = {"niah_single_noise": 24, "niah_single_essay": 24, "niah_single_uuid": 48,
                  "niah_multikey": 24, "niah_multivalue": 64, "niah_multiquery": 64, "vt": 48,
                  "cwe": 96, "fwe": 40}

_CWE_QUESTION = ("The text above is a numbered list of words; some words appear much more often "
                 "than others. What are the 10 most common words in the list?")
_CWE_PREFIX = "The 10 most common words in the list above are:"
_FWE_QUESTION = ("The text above is a coded text of made-up words. What are the three most "
                 "frequently appearing words in the coded text?")
_FWE_PREFIX = "The three most frequently appearing words in the coded text are:"

# Real English words for cwe's lists and niah's keys. _POOL drops short words, words found in
# the cwe templates and any word inside another, so a wrong word never scores a substring hit.
_WORD_TEXT = """
absence accent acorn actor admiral advice airport album alley almond amber anchor angle ankle
answer antelope anvil apple apricot apron archer arena armchair arrow artist ashtray atlas attic
auction aunt author autumn avenue avocado badge badger bagel baker balcony ballet balloon bamboo
banana bandit banjo banner barber barley barrel basket bathtub battery beach beacon beaver bedroom
beetle bell belt bench berry bicycle blanket blender blossom bonnet bottle boulder bracelet branch
brass bread breeze brick bridge broom brother bubble bucket buffalo bugle bundle bunker burrow
butter button cabbage cabin cable cactus camel camera canal candle canoe canvas canyon captain
caravan carpet carrot castle cattle cavern cedar cellar cement cereal chair chalk channel chapel
cheese cherry chess chicken chimney chisel circus citizen clarinet cliff clock closet cloud clover
coast cobweb coconut coffee collar comet compass concert copper coral cotton cousin cradle crane
crater crayon cricket crown crystal cucumber cupboard curtain cushion custard cycle daisy dancer
dentist desert diamond dinner doctor dolphin donkey doorbell dragon drawer dream dress drizzle
drum duck eagle easel eclipse eggplant elbow elephant elevator emerald engine envelope eraser
falcon farmer feather fence ferry festival fiddle field finger firefly flag flame flannel flute
forest fossil fountain fox freckle fridge frog frost furnace gadget galaxy garage garden garlic
gazelle geyser ghost giant ginger giraffe glacier glove goat goblet goose gorilla granite grape
gravel guitar gutter hammer hamster harbor harp harvest hatchet hazel helmet hermit highway hippo
hockey honey horizon hornet hospital hotel husband igloo iguana island ivory jacket jaguar jasmine
jelly jewel jigsaw journal judge juggler jungle kangaroo kayak kernel kettle kidney kitchen kite
kitten knife koala ladder ladle lagoon lamb lantern laptop laundry lava lawyer leather lemon
leopard letter lettuce library lighthouse lily limb lizard lobster locket lumber lynx magnet
mailbox mango maple marble market meadow melon mermaid meteor mirror mitten monkey moose mosquito
motor mountain muffin mule mushroom museum musician mustard napkin necklace needle nephew nest
nickel noodle notebook novel nugget nurse nutmeg oasis ocean octopus olive onion orange orchard
orchid ostrich otter oven owl oyster paddle palace panda panther papaya parade parcel parrot
pasta pastry peach peanut pebble pelican pencil penguin pepper piano pickle pigeon pillow pilot
pine pirate pizza planet plum pocket poet pony poppy porch potato pretzel puddle pumpkin puppet
puzzle pyramid quarry quill quilt rabbit raccoon radar radish raft rainbow raisin ranch raven
razor ribbon riddle river robin rocket rooster saddle sailor salmon sandal satellite saucer
sausage scarf scissors scooter sculptor seagull shadow shark shelf shovel shrimp silver singer
skate skeleton sketch skillet sled slipper snail snake sofa soldier spider spinach sponge spoon
squirrel stable stadium stamp statue stereo stool storm stove strawberry submarine suitcase
summit sunflower swan sweater syrup tablet tadpole tailor tambourine teapot telescope temple
tennis tent thimble thistle thunder ticket tiger toaster tomato tongue tortoise towel tractor
trumpet tulip tunnel turkey turnip turtle tuxedo umbrella unicorn valley vase velvet violin
volcano waffle wagon walnut walrus wardrobe wasp watch waterfall weasel whale wheat whistle
willow window wizard wolf yacht yogurt zebra zipper hamlet goblin gondola harpoon icicle lemur
mammoth marimba mongoose muskrat nectar nomad oboe opal orbit paprika parsley peacock pendant
petal pheasant pilgrim pistachio plaza prairie puffin pulley quartz quiver reindeer relic rhubarb
saffron sapphire scallop schooner scorpion sequoia sherbet sickle silo sparrow spruce stallion
starfish stirrup sultan swamp tangerine tapestry terrace thermos throne tinsel topaz torch
trellis trolley trout tundra turban vanilla vessel vulture walkway warbler wigwam wombat yodel
zucchini cobra condor cougar coyote cricketer dingo ferret flamingo gecko grizzly heron hyena
ibis jackal lark magpie manatee marmot mink narwhal ocelot oriole osprey pangolin parakeet
porcupine quail salamander sardine seahorse skunk sloth stork tapir toucan viper wren yak
"""
_RESERVED = " ".join((_CWE_QUESTION, _CWE_PREFIX, _FWE_QUESTION, _FWE_PREFIX,
                      NEEDLE, "special magic numbers uuids mentioned provided text")).lower()


def _word_pool(text: str) -> tuple[str, ...]:
    words = list(dict.fromkeys(w for w in text.split() if len(w) >= 4 and w not in _RESERVED))
    return tuple(w for w in words if not any(w != v and w in v for v in words))


_POOL: tuple[str, ...] = _word_pool(_WORD_TEXT)
WORD_POOL = _POOL  # public: the needle's keys draw their nouns from it

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class Sample:
    """One task instance; see the module docstring for each task's format."""

    task: str
    context: str  # the document
    question: str  # asked after the document
    answer_prefix: str  # the assistant's reply starts with this text (may be "")
    outputs: tuple[str, ...]  # every expected string (scored with string_match_all)
    depth: float | None  # tokens before the (first expected) needle / context tokens, or None
    max_new_tokens: int  # a sufficient answer length in tokens for this task
    facts: tuple[str, ...] = ()  # every key and value the sample draws (distractors included)


def tolerance(context_tokens: int) -> int:
    """How far below ``context_tokens`` a context may fall: max(16, floor(2%))."""
    return max(16, context_tokens // 50)


def load_essays(path: str | Path = ESSAYS) -> str:
    """The essay haystack text: the ``*.txt`` files of a directory (sorted), a text file or a
    RULER JSON file (``"text"``), joined with blank lines (``evals.prompts.read_texts``).

    Raises:
        ConfigError: the source is missing, unreadable or empty.
    """
    return "\n\n".join(t.strip() for t in read_texts([str(path)]))


# --------------------------------------------------------------------------------------------
# Sentence haystacks with needles


@dataclass
class _Piece:
    text: str
    cost: int  # tokens of the stripped text, at least 1
    needle: int | None = None  # index into the task's needles; None for a haystack sentence


def _render(pieces: Sequence[_Piece]) -> str:
    """The pieces joined, with a space between two when the first ends without whitespace."""
    parts: list[str] = []
    for p in pieces:
        if parts and not parts[-1][-1:].isspace():
            parts.append(" ")
        parts.append(p.text)
    return "".join(parts).strip()


@functools.lru_cache(maxsize=4)
def _essay_sentences(essays: str) -> tuple[str, ...]:
    return tuple(split_sentences(essays))


class _Source:
    """Haystack sentences read cyclically from ``start``; each distinct one counted once."""

    def __init__(self, sentences: Sequence[str], start: int, count: CountTokens, limit: int):
        self.sentences = sentences
        self.pos = start
        self.count = count
        self.costs: dict[int, int] = {}
        self.left = limit  # sentences that may still be read (guards against endless scans)

    def take(self, room: int, max_misses: int = 64) -> list[_Piece]:
        """The next sentences whose counts add up to at most ``room``; one that does not fit
        the remaining room is skipped; stops after ``max_misses`` skips in a row."""
        out: list[_Piece] = []
        misses = 0
        while room > 0 and misses < max_misses and self.left > 0:
            i = self.pos % len(self.sentences)
            text = self.sentences[i]
            self.pos += 1
            self.left -= 1
            if i not in self.costs:
                self.costs[i] = max(1, self.count(text.strip()))
            cost = self.costs[i]
            if cost <= room:
                out.append(_Piece(text, cost))
                room -= cost
                misses = 0
            else:
                misses += 1
        return out


def _drop(pieces: list[_Piece], excess: int) -> None:
    """Remove haystack sentences worth at least ``excess`` tokens: the cheapest single one
    among the last 64 that is worth enough, else sentences from the end."""
    hay = [i for i, p in enumerate(pieces) if p.needle is None]
    if not hay:
        return
    fits = [i for i in hay[-64:] if pieces[i].cost >= excess]
    if fits:
        del pieces[min(fits, key=lambda i: (pieces[i].cost, -i))]
        return
    removed = 0
    for i in reversed(hay):
        removed += pieces[i].cost
        del pieces[i]
        if removed >= excess:
            return


def _settle(pieces: list[_Piece], tail: Sequence[_Piece], source: _Source, target: int,
            tol: int, count: CountTokens) -> tuple[list[_Piece], int]:
    """Drop or add haystack sentences until ``pieces + tail`` counts within [target - tol,
    target] (added sentences go at the end of ``pieces``); returns them and the count."""
    n = count(_render([*pieces, *tail]))
    for _ in range(32):
        if n > target:
            _drop(pieces, n - target)
        elif n < target - tol:
            more = source.take(target - n)
            if not more:
                break
            pieces.extend(more)
        else:
            return pieces, n
        n = count(_render([*pieces, *tail]))
        if not any(p.needle is None for p in pieces):
            break
    while n > target and any(p.needle is None for p in pieces):
        _drop(pieces, n - target)
        n = count(_render([*pieces, *tail]))
    return pieces, n


def _needle_document(task: str, sentences: Sequence[str], start: int, needles: Sequence[str],
                     expected: Sequence[int], shuffle: bool, rng: random.Random, target: int,
                     count: CountTokens) -> tuple[str, float, int]:
    """Haystack sentences from ``sentences[start]`` on with ``needles`` at sentence boundaries;
    the context, the depth of the first needle whose index is in ``expected`` and the
    context's token count."""
    tol = tolerance(target)
    costs = [max(1, count(n)) for n in needles]
    if 2 * sum(costs) > target:
        raise ValueError(f"context_tokens={target} is too small for {task}: its needles take "
                         f"{sum(costs)} tokens and need at least as many of haystack (at least "
                         f"{2 * sum(costs)} tokens)")
    source = _Source(sentences, start, count, limit=2 * target + 10_000)
    needle_pieces = [_Piece(t, c, i) for i, (t, c) in enumerate(zip(needles, costs))]
    hay = source.take(target - sum(costs))
    # Fit the haystack with the needles at the end (their place barely changes the count) ...
    hay, _ = _settle(hay, needle_pieces, source, target, tol, count)
    if not hay:
        raise ValueError(f"context_tokens={target} is too small for {task}: no haystack "
                         "sentence fits beside the needles")
    # ... then put them at boundaries drawn uniformly, and settle the last token or two.
    k = len(needles)
    if k == 1:
        bounds = [rng.randint(0, len(hay))]
    elif len(hay) + 1 >= k:
        bounds = sorted(rng.sample(range(len(hay) + 1), k))
    else:
        bounds = sorted(rng.choices(range(len(hay) + 1), k=k))
    order = list(needle_pieces)
    if shuffle:
        rng.shuffle(order)
    pieces: list[_Piece] = []
    j = 0
    for b in range(len(hay) + 1):
        while j < k and bounds[j] == b:
            pieces.append(order[j])
            j += 1
        if b < len(hay):
            pieces.append(hay[b])
    pieces, n = _settle(pieces, [], source, target, tol, count)
    context = _render(pieces)
    first = next(i for i, p in enumerate(pieces) if p.needle in expected)
    depth = count(_render(pieces[:first])) / n if first else 0.0
    return context, min(1.0, depth), n


def _keys(rng: random.Random, k: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < k:
        a, b = rng.sample(_POOL, 2)
        if f"{a}-{b}" not in keys:
            keys.append(f"{a}-{b}")
    return keys


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _niah(task: str, rng: random.Random, target: int, count: CountTokens,
          essays: str | None) -> tuple[Sample, int]:
    if task == "niah_single_noise":
        sentences: Sequence[str] = NOISE_SENTENCES
        start = 0
    else:
        if essays is None:
            raise ValueError(f"{task} needs the essays text (essays=...) for its haystack")
        sentences = _essay_sentences(essays)
        if not sentences:
            raise ValueError(f"{task}: the essays text has no sentence")
        start = rng.randrange(len(sentences))
    n_keys = NUM_NEEDLES if task in ("niah_multikey", "niah_multiquery") else 1
    n_values = NUM_NEEDLES if task == "niah_multivalue" else n_keys
    keys = _keys(rng, n_keys)
    if task == "niah_single_uuid":
        values = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(n_values)]
        kind = "uuid"
    else:
        values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), n_values)]
        kind = "number"
    needle_keys = keys if n_keys == n_values else keys * n_values
    needles = [NEEDLE.format(kinds=kind + "s", key=k, value=v)
               for k, v in zip(needle_keys, values)]
    if task == "niah_multikey":
        expected = [0]  # keys[0] is asked, the others are distractors
    else:
        expected = list(range(len(needles)))
    if len(expected) == 1:
        question = f"What is the special magic {kind} for {keys[0]} mentioned in the provided text?"
        prefix = f"The special magic {kind} for {keys[0]} mentioned in the provided text is"
    else:
        asked = _and(keys)
        question = (f"What are all the special magic {kind}s for {asked} mentioned in the "
                    "provided text?")
        prefix = f"The special magic {kind}s for {asked} mentioned in the provided text are"
    context, depth, n = _needle_document(task, sentences, start, needles, expected,
                                         shuffle=len(needles) > 1, rng=rng, target=target,
                                         count=count)
    return Sample(task, context, question, prefix, tuple(values[i] for i in expected), depth,
                  MAX_NEW_TOKENS[task], tuple(keys) + tuple(values)), n


def _vt(rng: random.Random, target: int, count: CountTokens) -> tuple[Sample, int]:
    value = str(rng.randint(10_000, 99_999))
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    statements = [f"VAR {names[0]} = {value}."]
    statements += [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    context, depth, n = _needle_document("vt", NOISE_SENTENCES, 0, statements, [0],
                                         shuffle=False, rng=rng, target=target, count=count)
    question = ("The text above hides a chain of variable assignments (VAR ... = ...). Find all "
                f"variables that are assigned the value {value} in the text above.")
    prefix = (f"According to the chain of variable assignments in the text above, {len(names)} "
              f"variables are assigned the value {value}, they are:")
    return Sample("vt", context, question, prefix, tuple(names), depth, MAX_NEW_TOKENS["vt"],
                  (*names, value)), n


# --------------------------------------------------------------------------------------------
# List tasks


def _fit_items(task: str, render: Callable[[int], str], count: CountTokens, lo: int, hi: int,
               guess: float, per_item: float, target: int) -> tuple[int, str, int]:
    """The item count r in [lo, hi] whose rendered text counts within [target - tol, target],
    searched with whole counts from ``guess``; failing that, the one with the largest count
    not over ``target``. Returns (r, text, count).

    Raises:
        ValueError: even ``lo`` items count more than ``target``.
    """
    tol = tolerance(target)
    seen: dict[int, tuple[int, str]] = {}

    def n_of(r: int) -> int:
        if r not in seen:
            text = render(r)
            seen[r] = (count(text), text)
        return seen[r][0]

    slope = per_item
    prev = None
    r = min(hi, max(lo, round(guess)))
    for _ in range(24):
        n = n_of(r)
        if target - tol <= n <= target:
            break
        if prev is not None and (n - seen[prev][0]) * (r - prev) > 0:
            slope = (n - seen[prev][0]) / (r - prev)  # secant through the last two counts
        step = (target - min(tol / 3, 2 * slope) - n) / slope  # aim just inside the window
        step = (math.floor(step) if step > 0 else math.ceil(step)) or (1 if n < target else -1)
        nxt = min(hi, max(lo, r + step))
        if nxt in seen:  # already counted: walk one item at a time towards the window
            nxt = min(hi, max(lo, r + (1 if n < target else -1)))
            if nxt in seen:
                break
        prev, r = r, nxt
    fits = [q for q in seen if seen[q][0] <= target]
    if not fits:
        raise ValueError(f"context_tokens={target} is too small for {task}: its smallest list "
                         f"takes {n_of(lo)} tokens")
    best = max(fits, key=lambda q: (seen[q][0], q))
    return best, seen[best][1], seen[best][0]


def _numbered(words: Sequence[str]) -> str:
    return "\n".join(f"{i}. {w}" for i, w in enumerate(words, 1))


def _cwe(rng: random.Random, target: int, count: CountTokens) -> tuple[Sample, int]:
    words = rng.sample(_POOL, len(_POOL))
    common, rare_pool = words[:CWE_COMMON], words[CWE_COMMON:]
    # Tokens per item: probe 64 items, then 64 more numbered like a list of the estimated size.
    probe = words[:64]
    per_item = max(1.0, count(_numbered(probe)) / len(probe))
    n_est = target / per_item
    positions = [max(1, round(n_est * (i + 0.5) / len(probe))) for i in range(len(probe))]
    per_item = max(1.0, count("\n".join(f"{k}. {w}" for k, w in zip(positions, probe)))
                   / len(probe))
    n_est = target / per_item
    if n_est < 3 * CWE_COMMON + 10:
        raise ValueError(f"context_tokens={target} is too small for cwe: about {n_est:.0f} "
                         f"list items fit, it needs {3 * CWE_COMMON + 10}")
    f_common = min(CWE_MAX_FREQ, max(3, round(0.35 * n_est / CWE_COMMON)))
    f_rare = max(1, min(3, f_common // 3))
    rare_est = max(0.0, n_est - CWE_COMMON * f_common)
    f_rare = max(f_rare, math.ceil(1.3 * rare_est / len(rare_pool)))
    if 2 * f_rare > f_common:  # a very long list: more of everything
        f_common = 2 * f_rare
        rare_est = max(0.0, n_est - CWE_COMMON * f_common)
    n_rare_words = min(len(rare_pool), math.ceil(1.3 * rare_est / f_rare) + 1)
    rare_seq = [w for _ in range(f_rare) for w in rare_pool[:n_rare_words]]
    perm_seed = rng.getrandbits(64)

    def render(r: int) -> str:
        items = common * f_common + rare_seq[:r]
        random.Random(perm_seed).shuffle(items)
        return _numbered(items)

    lo = min(len(rare_seq), CWE_COMMON)
    _, context, n = _fit_items("cwe", render, count, lo, len(rare_seq), rare_est, per_item,
                               target)
    return Sample("cwe", context, _CWE_QUESTION, _CWE_PREFIX, tuple(common), None,
                  MAX_NEW_TOKENS["cwe"], (" ".join(sorted(common)),)), n


def _made_up_words(rng: random.Random) -> Iterator[str]:
    """Distinct 6-letter consonant-vowel words, in the order drawn."""
    seen: dict[str, None] = {}
    while True:
        w = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(3))
        if w not in seen:
            seen[w] = None
            yield w


def _zipf_counts(n: int) -> list[int]:
    """Counts per rank of ``n`` words: floor(n r**-a / zeta(a)), then 1 for each word left
    over, under new ranks."""
    counts = []
    r = 1
    while True:
        c = math.floor(n * r ** -FWE_ALPHA / _FWE_ZETA)
        if c < 1:
            break
        counts.append(c)
        r += 1
    return counts + [1] * (n - sum(counts))


def _fwe(rng: random.Random, target: int, count: CountTokens) -> tuple[Sample, int]:
    gen = _made_up_words(rng)
    vocab: list[str] = []

    def words(k: int) -> list[str]:
        while len(vocab) < k:
            vocab.append(next(gen))
        return vocab[:k]

    probe = words(64)
    per_item = max(1.0, count(" ".join(probe)) / len(probe))
    perm_seed = rng.getrandbits(64)

    def render(n: int) -> str:
        counts = _zipf_counts(n)
        items = [w for w, c in zip(words(len(counts)), counts) for _ in range(c)]
        random.Random(perm_seed).shuffle(items)
        return " ".join(items)

    n_est = target / per_item
    n_words, context, n = _fit_items("fwe", render, count, 1, max(64, round(2 * n_est) + 64),
                                     n_est, per_item, target)
    counts = _zipf_counts(n_words)
    if len(counts) <= FWE_TOP or counts[FWE_TOP - 1] <= counts[FWE_TOP]:
        raise ValueError(f"context_tokens={target} is too small for fwe: {n_words} words do not "
                         f"give {FWE_TOP} words more frequent than all others")
    return Sample("fwe", context, _FWE_QUESTION, _FWE_PREFIX, tuple(words(FWE_TOP)), None,
                  MAX_NEW_TOKENS["fwe"], tuple(words(FWE_TOP))), n


# --------------------------------------------------------------------------------------------


def make_sample(task: str, context_tokens: int, count_tokens: CountTokens, seed: int,
                essays: str | None = None) -> Sample:
    """One deterministic sample of ``task`` whose context counts at most ``context_tokens``
    and at least ``context_tokens - tolerance(context_tokens)`` tokens by ``count_tokens``.

    Args:
        task: one of ``TASKS``.
        context_tokens: the context's length in tokens.
        count_tokens: tokens of a text (e.g. ``len(tok.encode(text, bos=False))``).
        seed: with ``task``, seeds every random choice.
        essays: the essay haystack text (e.g. ``load_essays()``); needed by ``ESSAY_TASKS``.

    Raises:
        ValueError: unknown task, non-positive ``context_tokens``, ``context_tokens`` too small
            for the task, or no (or sentence-less) ``essays`` for an essay task.
        RuntimeError: the context could not be brought within the tolerance (a token counter
            far from additive over sentences or items).
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if context_tokens <= 0:
        raise ValueError(f"context_tokens must be positive, got {context_tokens}")
    if task in ESSAY_TASKS and essays is None:
        raise ValueError(f"{task} needs the essays text (essays=...) for its haystack")
    rng = random.Random(f"{task}:{seed}")
    if task == "vt":
        sample, n = _vt(rng, context_tokens, count_tokens)
    elif task == "cwe":
        sample, n = _cwe(rng, context_tokens, count_tokens)
    elif task == "fwe":
        sample, n = _fwe(rng, context_tokens, count_tokens)
    else:
        sample, n = _niah(task, rng, context_tokens, count_tokens, essays)
    low = context_tokens - tolerance(context_tokens)
    if not low <= n <= context_tokens:
        raise RuntimeError(f"{task}: the context counts {n} tokens, outside [{low}, "
                           f"{context_tokens}]")
    return sample


# --------------------------------------------------------------------------------------------
# The tasks as harness items


def sample_seed(task: str, length: int, index: int, seed: int = 0, split: str = "eval",
                attempt: int = 0) -> int:
    """The seed of sample ``index`` of ``task`` at prompt length ``length``:
    ``evals.prompts.prompt_seed`` of ("ruler", split, seed, task, length, index, attempt), so
    every (task, length, sample) draws its own keys, values and words."""
    return prompt_seed("ruler", split, seed, task, length, index, attempt)


MAX_REDRAWS = 50


def build_items(tok: Tokenizer, essays: str, tasks: Sequence[str], lengths: Sequence[int],
                samples: int, seed: int, split: str = "eval") -> list[Item]:
    """Every sample of every task and length, as chat items grouped by (task, length).

    Sample j of a task at a length is drawn from ``sample_seed(task, length, j, seed,
    split)``; one whose facts (``Sample.facts``: keys, values, variable names, fwe's words,
    cwe's set of common words) repeat a fact of a sample drawn before it in this grid (lengths
    in the order given, then tasks, then samples) is redrawn with ``attempt`` 1, 2, ...: no two
    prompts of a grid share a fact. cwe's single words come from a pool of 590 and recur
    across samples; its set of 10 does not.

    Raises:
        ConfigError: a length too small for a task, or no fact-disjoint sample in
            ``MAX_REDRAWS`` draws.
    """
    def count(text: str) -> int:
        return len(tok.encode(text, bos=False))

    items = []
    used: set[str] = set()
    for length in lengths:
        for task in tasks:
            for j in range(samples):
                for attempt in range(MAX_REDRAWS):
                    s_seed = sample_seed(task, length, j, seed, split, attempt)
                    # the facts first, on a cheap counter: redraws cost no tokenizer pass
                    probe = make_sample(task, 512, lambda t: len(t) // 4, s_seed, essays)
                    if not used & set(probe.facts):
                        break
                else:
                    raise ConfigError(f"{task} at {length} tokens: no sample with new facts in "
                                      f"{MAX_REDRAWS} draws")
                head, tail = chat_pieces(tok, probe.question, probe.answer_prefix)
                room = length - len(head) - len(tail) - 8  # keys differ by a few tokens
                try:
                    s = make_sample(task, room, count, s_seed, essays)
                except ValueError as e:
                    raise ConfigError(f"{task} at {length} tokens: {e}") from None
                used.update(s.facts)
                head, tail = chat_pieces(tok, s.question, s.answer_prefix)
                items.append(Item(head + tok.encode(s.context, bos=False), tail, s.outputs, {
                    "task": task, "length": length, "sample": j, "seed": s_seed,
                    "depth": s.depth, "outputs": list(s.outputs), "facts": list(s.facts),
                    "max_new_tokens": s.max_new_tokens, "group": (task, length)}, len(head)))
    return items


# --------------------------------------------------------------------------------------------
# Scoring


class _MadeUpWords:
    """fwe's vocabulary: every 6-letter consonant-vowel word (``in`` tests the pattern)."""

    _RE = re.compile(f"(?:[{_CONSONANTS}][{_VOWELS}]){{3}}")

    def __contains__(self, word: object) -> bool:
        return isinstance(word, str) and self._RE.fullmatch(word) is not None


TASK_KINDS: dict[str, tuple[str, Any]] = {
    "niah_single_noise": ("number", None), "niah_single_essay": ("number", None),
    "niah_single_uuid": ("uuid", None), "niah_multikey": ("number", None),
    "niah_multivalue": ("number", None), "niah_multiquery": ("number", None),
    "vt": ("name", None), "cwe": ("word", frozenset(_POOL)), "fwe": ("word", _MadeUpWords()),
}
PASS_FAIL_TASKS: tuple[str, ...] = ("niah_single_noise", "niah_single_essay",
                                    "niah_single_uuid", "niah_multikey")


def asked_keys(task: str, facts: Sequence[str], outputs: Sequence[str]) -> list[str] | None:
    """The keys of a ``niah_multiquery`` item in the order its question asks them, ``keys[i]``
    owning ``outputs[i]``: its ``facts`` are the 4 keys then their 4 values (``_niah``:
    ``Sample.facts`` = keys + values, the question asks the keys in that order and ``outputs``
    are the values). None for every other task.

    Raises:
        ValueError: ``facts`` is not the keys followed by ``outputs``.
    """
    if task != "niah_multiquery":
        return None
    n = len(outputs)
    if len(facts) != 2 * n or list(facts[n:]) != list(outputs):
        raise ValueError(f"niah_multiquery facts must be its {n} keys then its {n} values "
                         f"(the outputs), got {list(facts)} for outputs {list(outputs)}")
    return list(facts[:n])


def score_task(task: str, prediction: str, outputs: Sequence[str], *, capped: bool = False,
               facts: Sequence[str] | None = None) -> float | None:
    """The boundary-aware score of an answer to ``task`` (``evals.scoring.score_answer``):
    pass/fail on the first value stated for ``PASS_FAIL_TASKS`` (one expected value), F1 over
    the distinct values stated for the others. Candidates by task (``TASK_KINDS``): numbers of
    4+ digits for the niah number tasks, UUIDs, vt's upper-case 5-letter names, cwe's pool
    words, fwe's consonant-vowel words.

    Args:
        task, prediction, outputs: the task, the answer and the expected values.
        capped: the answer stopped at its ``max_new_tokens``, not at a stop token: a last
            value ending at the very end of the answer is dropped as possibly cut, neither
            right nor wrong (a number only when some expected value starts with it).
        facts: the item's ``facts`` (``Sample.facts``, the item's ``meta["facts"]``); for
            ``niah_multiquery`` they give the asked keys (``asked_keys``) and a value then
            counts only under its own key. Without them (the default) multiquery is scored as
            a plain list, as before.

    Returns:
        A score in [0, 1], or None when ``capped`` left a one-answer task no complete value.

    Raises:
        ValueError: unknown task, no outputs, or multiquery ``facts`` that are not its keys
            then its outputs.
    """
    if task not in TASK_KINDS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    kind, vocab = TASK_KINDS[task]
    keys = None if facts is None else asked_keys(task, facts, outputs)
    return score_answer(prediction, outputs, kind, vocab, capped=capped, keys=keys)


def score_item(answer: str, item: Item, *, capped: bool | None = False) -> float | None:
    """``score_task`` of a harness item's answer (the harness's ``score``,
    ``evaluate_items``): the item's task (``meta["task"]``) and expected ``outputs``, with
    ``capped`` as the run recorded it (``harness.Answers.capped``: the answer ended at its
    ``max_new_tokens``, not at a stop token), so a value the cap cut is neither right nor
    wrong; None (not recorded) scores as not capped. The item's ``facts`` (``meta["facts"]``,
    where it has them) go along: niah_multiquery counts a value only under its own key.

    Returns:
        A score in [0, 1], or None when ``capped`` left a one-answer task no complete value.
    """
    return score_task(item.meta["task"], answer, item.outputs, capped=bool(capped),
                      facts=item.meta.get("facts"))


def task_rows(rows: Sequence[dict[str, Any]], items: Sequence[Item],
              tasks: Sequence[str]) -> list[dict[str, Any]]:
    """Per row: ``per_task`` {task: mean score over its items that ran and got a score (None
    scores, unfinished items or a cut answer with no verdict, are left out), None if none} and
    ``score`` = the mean over tasks, None unless every task ran (an average over fewer tasks
    would not compare with the other rows); the same from ``scores_substring`` as
    ``per_task_substring`` and ``score_substring`` when the row has them."""
    for r in rows:
        if "error" in r:
            continue
        for key, per_key, score_key in (("scores", "per_task", "score"),
                                        ("scores_substring", "per_task_substring",
                                         "score_substring")):
            if key not in r:
                continue
            per = {}
            for t in tasks:
                s = [x for x, it in zip(r[key], items) if it.meta["task"] == t and x is not None]
                per[t] = sum(s) / len(s) if s else None
            r[per_key] = per
            vals = [v for v in per.values() if v is not None]
            r[score_key] = sum(vals) / len(vals) if len(vals) == len(per) else None
    return list(rows)
