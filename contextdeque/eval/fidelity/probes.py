"""The fidelity probe set: deterministic multi-chunk items (2-6 chunks of 128-512 tokens each).

Three families, all built from material on this machine, nothing downloaded:

- ``pydoc``: real English from CPython's own reference manual (``pydoc_data.topics``, the text
  ``help()`` shows). Each chunk documents one topic; the question needs the chunks' order (which
  topic follows which), i.e. binding across chunks. Texts follow the running CPython version.
- ``binding``: hand-written cross-chunk binding items: an entity is introduced in one chunk and
  referred to only by a description in a later one; the question needs both. Chunks are padded to
  length with neutral hand-written sentences (a seeded choice), some with distractor chunks between.
- ``image``: image spans made from real scikit-image pixels (``skimage.data``). EMULATION: no
  vision-language checkpoint exists here, so an image span is its pixels patchified (16x16 px
  patches on a fixed grid), passed through a fixed seeded random projection into the LM's
  embedding space, and scaled to the LM's mean embedding norm; it is encoded with
  ``backend.encode(embeds=...)``. It exercises the same embedding-chunk path a real VLM's vision
  tower output would, not a model that can see.

Each item holds its chunks, a question, and the reference answer (used for answer-match
reporting; flips are judged against the re-prefill's own greedy answer). The query closes the
user turn and opens the assistant turn with the tokenizer's own chat template (ChatML for the
default model).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ...core.chunk import Chunk
from ...core.errors import EmptyChunkError
from ...model.images import embedding_norm, image_span_embeddings
from ...model.text import query_suffix, tokenize

MIN_CHUNK_TOKENS = 128
MAX_CHUNK_TOKENS = 512
PYDOC_MAX_CHARS = 1700


@dataclass(frozen=True)
class ProbeChunk:
    """One chunk: ``kind`` "text" (``text``) or "image" (``image`` = a ``skimage.data`` name on a
    ``grid`` of (rows, cols) patches, so ``rows * cols`` tokens)."""

    kind: str
    text: str | None = None
    image: str | None = None
    grid: tuple[int, int] = (12, 12)


@dataclass(frozen=True)
class ProbeItem:
    """A probe item: ``chunks`` in window order, the ``question``, its reference ``answer``."""

    id: str
    family: str
    chunks: tuple[ProbeChunk, ...]
    question: str
    answer: str


@dataclass
class MaterializedItem:
    """A probe item turned into model inputs: canonical ``chunks``, ``query_ids`` (question +
    end of user turn + assistant header) and ``answer_ids``."""

    item: ProbeItem
    chunks: list[Chunk]
    query_ids: list[int]
    answer_ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------- pydoc items

# (topics in window order, question, answer). Questions need the order of the chunks.
_PYDOC_ITEMS: list[tuple[tuple[str, ...], str, str]] = [
    (("if", "while"), 'Which statement is documented right after the "if" statement? Answer with the keyword only.', "while"),
    (("for", "break", "return"), 'Which statement is documented right after the "break" statement? Answer with the keyword only.', "return"),
    (("assert", "del", "global", "return"), 'Which statement is documented right after the "del" statement? Answer with the keyword only.', "global"),
    (("global", "nonlocal", "yield"), 'Which statement is documented in the last passage? Answer with the keyword only.', "yield"),
    (("raise", "with"), 'The first passage documents one statement. Which statement does the second passage document? Answer with the keyword only.', "with"),
    (("try", "class", "function", "return", "while"), 'Which statement is documented right before the "return" statement? Answer with one word.', "function"),
    (("dict", "slicings", "truth", "booleans", "comparisons", "in"), "Which topic is documented in the third passage? Answer in a few words.", "Truth Value Testing"),
    (("integers", "floating", "imaginary", "if"), "Which kind of literal is documented right before the imaginary literals? Answer in a few words.", "Floating point literals"),
    (("unary", "binary", "power", "shifting", "bitwise"), "Which operations are documented right after the power operator? Answer in a few words.", "Shifting operations"),
    (("exceptions", "naming", "dynamic-features", "id-classes", "else"), "Which topic is documented right after the passage on naming and binding? Answer in a few words.", "Interaction with dynamic features"),
    (("atom-identifiers", "atom-literals", "attribute-references", "subscriptions", "calls", "exprlists"), "Which topic is documented right after attribute references? Answer in one word.", "Subscriptions"),
    (("typesmodules", "typesmethods", "specialattrs", "context-managers", "conversions"), "Which topic is documented in the passage right before the one on context managers? Answer in a few words.", "Special Attributes"),
]


def _pydoc_text(topic: str, max_chars: int = PYDOC_MAX_CHARS) -> str:
    """The topic's text, cut at a paragraph boundary to at most ``max_chars`` characters."""
    from pydoc_data.topics import topics

    text = topics[topic].strip()
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n\n", 0, max_chars)
    return text[: cut if cut > max_chars // 3 else max_chars].rstrip()


# ---------------------------------------------------------------------------- binding items

# Neutral sentences padding the binding and image-caption chunks (no names, no entities a
# question could ask about).
_FILLER = [
    "The morning train was twelve minutes late, as it had been every Monday that month.",
    "Rain had fallen overnight, and the cobbles along the river still shone in the weak sun.",
    "A delivery of oranges arrived at the covered market shortly before nine o'clock.",
    "Two schoolchildren argued about whether clouds were heavier in winter or in summer.",
    "The bakery on the corner sold out of rye bread before the church bells rang ten.",
    "A gust of wind lifted a stack of newspapers and scattered them across the square.",
    "The old ferry made its slow crossing every hour, carrying bicycles, crates and a few tourists.",
    "In the library, the reading room was quiet except for the ticking of the wall clock.",
    "The council had promised new street lamps, but the old ones were still flickering.",
    "A fishing boat returned early, its nets nearly empty after a night of rough water.",
    "Someone had left a chalk drawing of a sailing ship on the pavement by the school.",
    "The price of coffee at the station kiosk had gone up again, to general complaint.",
    "Swallows nested under the eaves of the post office for the third year running.",
    "The weather forecast promised sunshine, although nobody in town quite believed it.",
    "By noon the square was full of market stalls selling cheese, honey and wool.",
    "The road to the coast was closed for repairs, so traffic wound through the hills instead.",
    "An orchestra rehearsed in the town hall, stopping often to repeat the same few bars.",
    "The pharmacy put a new sign in its window announcing longer opening hours.",
    "Children raced paper boats along the gutter after the afternoon shower.",
    "A stray cat slept on the warm bonnet of a parked delivery truck.",
    "The annual fair was only three weeks away, and the posters were already fading.",
    "Fog rolled in from the estuary in the evening and hid the far bank completely.",
    "The tram line was extended by two stops, which pleased the people living near the hospital.",
    "A street musician played the accordion near the fountain for most of the afternoon.",
    "Workers repainted the railings of the bridge a dark shade of green.",
    "The harbour master counted forty-one boats moored in the marina that week.",
    "Apple trees in the public orchard were heavy with fruit by the end of August.",
    "A tour group stood in front of the cathedral while their guide searched for her notes.",
    "The museum extended its opening hours on Thursdays until eight in the evening.",
    "Snow fell briefly in the hills, although the valley stayed grey and damp.",
    "The local newspaper printed a long letter complaining about the noise of seagulls.",
    "Several shops closed for lunch between one and three, as they always had.",
    "The swimming pool reopened after repairs to its heating system.",
    "A kite caught in the branches of the tall chestnut tree by the playground.",
    "Freight trains rumbled through the station at night without stopping.",
    "The bookshop arranged a window display of maps and old travel guides.",
    "An early frost blackened the last of the tomatoes in the allotments.",
    "Bells from three different churches rang at slightly different moments every hour.",
    "The cinema showed the same old comedy every Sunday afternoon to a half-empty hall.",
    "Road signs at the crossroads pointed in four directions, two of them to the same village.",
    "Volunteers planted a row of young lime trees along the avenue leading to the station.",
    "A thick ledger on the counter of the hardware store recorded every sale by hand.",
]

# (setup sentence(s) in chunk A, reference sentence(s) in chunk B, question, answer, extra chunks)
# ``extra``: how many filler-only distractor chunks sit between A and B (2..6 chunks per item).
_BINDING_ITEMS: list[tuple[str, str, str, str, int]] = [
    ("The lighthouse keeper on Varn Island was a woman named Odile Marchetti.",
     "During the March storm, the lighthouse keeper rowed out alone and brought two stranded fishermen to the chapel on the hill.",
     "What is the name of the person who brought the fishermen to the chapel?", "Odile Marchetti", 0),
    ("Professor Hamid Qureshi kept a tortoise, which he had named Archimedes.",
     "Last spring the professor's tortoise escaped from the garden and was found asleep inside the museum's bronze bell.",
     "What is the name of the animal that was found inside the bronze bell?", "Archimedes", 1),
    ("The blue van parked in the depot belongs to the bakery run by Teodora Vasquez.",
     "On Tuesday the blue van was stopped at the bridge because it was carrying far too many crates of plums.",
     "Who runs the business that owns the vehicle stopped at the bridge?", "Teodora Vasquez", 2),
    ("The guards changed the code word for the northern gate; from now on it is 'juniper'.",
     "Anyone arriving at the northern gate after dark must say the code word to the guards before they are let in.",
     "What word must a visitor say at the northern gate after dark?", "juniper", 3),
    ("The oldest resident of the village is a clockmaker called Benedek Halmi.",
     "To celebrate his hundredth birthday, the oldest resident of the village climbed the church tower and repaired its clock.",
     "Who repaired the church tower clock?", "Benedek Halmi", 0),
    ("The violinist Mireille Fontaine always performs with an old instrument that she calls the Crow.",
     "An hour before the final concert, the Crow cracked along its neck and had to be glued in a hurry.",
     "Whose instrument cracked before the final concert?", "Mireille Fontaine", 1),
    ("Every winter, room 214 of the Hotel Calder is reserved for a retired pilot, Captain Ilse Brandt.",
     "This year the guest in room 214 complained to the manager that the radiator whistled all night long.",
     "Who complained about the whistling radiator?", "Ilse Brandt", 4),
    ("The red notebook on the kitchen shelf holds the recipe for the festival soup, written out by the chef Anselm Rook.",
     "Someone borrowed the red notebook and returned it with the page about the festival soup torn out.",
     "Who wrote the recipe that was torn out of the notebook?", "Anselm Rook", 2),
    ("The cargo ship Kestrel is captained by Nadia Okonkwo, who sails it between Lisbon and Dakar.",
     "Last week the Kestrel lost its mainsail in a squall and limped into a small fishing harbour.",
     "Who captains the ship that lost its mainsail?", "Nadia Okonkwo", 3),
    ("The youngest member of the town council is Pavel Strnad, who is nineteen years old.",
     "At the spring meeting, the youngest member of the council proposed painting every bench in the park yellow.",
     "Who proposed painting the benches yellow?", "Pavel Strnad", 1),
    ("The large painting in the entrance hall is a portrait of Lady Wenonah Ashby.",
     "The key to the greenhouse always hangs on a small hook behind the large painting in the entrance hall.",
     "Behind whose portrait does the greenhouse key hang?", "Wenonah Ashby", 4),
    ("Marisol owns a grey greyhound called Pepper.",
     "At the county fair, Pepper won the autumn race by three full lengths.",
     "Who owns the dog that won the autumn race?", "Marisol", 0),
    ("The mountain hut at Col Blanc is looked after by twin brothers, Emil and Otto Sauter.",
     "In August the two men who look after the hut at Col Blanc carried a hiker with a broken ankle down to the valley.",
     "What is the family name of the brothers who carried the hiker down?", "Sauter", 3),
    ("The laboratory's oldest microscope was a gift from the physician Dr. Ruth Abernathy.",
     "On Friday a student knocked the oldest microscope off the bench, and its main lens shattered on the floor.",
     "Who gave the laboratory the microscope whose lens shattered?", "Ruth Abernathy", 2),
    ("Ines Carvalho owns a small bookshop called The Lantern. The Lantern stands next to the fish market.",
     "On Friday night a fire broke out in the shop next to the fish market, and the street was closed until morning.",
     "Whose shop caught fire on Friday night?", "Ines Carvalho", 1),
    ("The tallest tree in the park, an old oak, was planted sixty years ago by the poet Lucan Mbeki.",
     "During the August storm, lightning struck the tallest tree in the park and split its trunk in two.",
     "Who planted the tree that the lightning struck?", "Lucan Mbeki", 4),
]


def _filler(rng: random.Random, n: int) -> list[str]:
    return rng.sample(_FILLER, n)


def _padded(core: Sequence[str], rng: random.Random, n_filler: int) -> str:
    """Core sentences placed among ``n_filler`` neutral sentences at seeded positions."""
    sents = _filler(rng, n_filler)
    for s in core:
        sents.insert(rng.randrange(len(sents) + 1), s)
    return " ".join(sents)


# ---------------------------------------------------------------------------- image items

# (chunks: ("text", core sentence) or ("image", skimage name, (rows, cols)), question, answer)
_IMAGE_ITEMS: list[tuple[list[tuple], str, str]] = [
    ([("text", "The photograph that follows was taken by the photographer Ana Ruiz at a space centre."),
      ("image", "astronaut", (12, 12))],
     "Who took the photograph?", "Ana Ruiz"),
    ([("image", "coffee", (12, 16)),
      ("text", "The picture above was taken at the Gallo Nero cafe in the city of Trieste.")],
     "In which city was the picture taken?", "Trieste"),
    ([("text", "Two photographs follow. The first shows a cat called Mochi; the second shows a cameraman."),
      ("image", "chelsea", (12, 16)), ("image", "camera", (12, 12))],
     "What is the cat in the first photograph called?", "Mochi"),
    ([("image", "rocket", (12, 16)),
      ("text", "The rocket in the picture above was launched from a base in French Guiana."),
      ("image", "moon", (12, 12)),
      ("text", "The second picture, of the Moon, was taken through a small telescope by Kofi Mensah.")],
     "Who took the picture of the Moon?", "Kofi Mensah"),
    ([("text", "The following scans come from the archive of the museum curator, Helga Lindqvist."),
      ("image", "coins", (12, 14)), ("image", "page", (8, 16)), ("image", "text", (8, 16))],
     "Whose archive do the scans come from?", "Helga Lindqvist"),
    ([("image", "immunohistochemistry", (12, 12)),
      ("text", "The stained tissue sample shown above was prepared by the technician Yusuf Demir."),
      ("image", "hubble_deep_field", (12, 14)),
      ("text", "The deep field image above was processed by the astronomer Clara Weiss."),
      ("image", "clock", (12, 16))],
     "Who prepared the stained tissue sample?", "Yusuf Demir"),
    ([("text", "Six pictures follow, all taken on one walk. They are numbered in the order they were taken."),
      ("image", "brick", (12, 12)), ("image", "grass", (12, 12)), ("image", "gravel", (12, 12)),
      ("image", "colorwheel", (12, 12)),
      ("text", "The photographer who took these pictures on the walk is called Tomas Varga.")],
     "What is the name of the photographer who took the pictures?", "Tomas Varga"),
    ([("image", "chelsea", (12, 16)),
      ("text", "The cat in the picture above belongs to a sailor named Joaquim Reis."),
      ("image", "coffee", (12, 16)),
      ("text", "The cup of coffee in the second picture was served to the cat's owner.")],
     "To whom was the cup of coffee served?", "Joaquim Reis"),
]


# ---------------------------------------------------------------------------- the set


def probe_set(n_items: int | None = None, *, seed: int = 0) -> list[ProbeItem]:
    """The deterministic probe set (``n_items`` first items, interleaving the families).

    36 items: 12 ``pydoc``, 16 ``binding``, 8 ``image``; 2-6 chunks each.
    """
    rng = random.Random(seed)
    pydoc: list[ProbeItem] = []
    for i, (topics, q, a) in enumerate(_PYDOC_ITEMS):
        chunks = tuple(ProbeChunk("text", text=_pydoc_text(t)) for t in topics)
        pydoc.append(ProbeItem(f"pydoc-{i:02d}", "pydoc", chunks, q, a))
    binding: list[ProbeItem] = []
    for i, (setup, ref, q, a, extra) in enumerate(_BINDING_ITEMS):
        parts = [_padded([setup], rng, 9)]
        parts += [_padded([], rng, 9) for _ in range(extra)]
        parts.append(_padded([ref], rng, 9))
        binding.append(ProbeItem(f"binding-{i:02d}", "binding", tuple(ProbeChunk("text", text=p) for p in parts), q, a))
    image: list[ProbeItem] = []
    for i, (spec, q, a) in enumerate(_IMAGE_ITEMS):
        chunks = []
        for c in spec:
            if c[0] == "text":
                chunks.append(ProbeChunk("text", text=_padded([c[1]], rng, 8)))
            else:
                chunks.append(ProbeChunk("image", image=c[1], grid=tuple(c[2])))
        image.append(ProbeItem(f"image-{i:02d}", "image", tuple(chunks), q, a))
    # interleave so that a prefix (--items N) covers every family
    out: list[ProbeItem] = []
    pools = [binding, pydoc, image]
    while any(pools):
        for p in pools:
            if p:
                out.append(p.pop(0))
    return out if n_items is None else out[: int(n_items)]


# ---------------------------------------------------------------------------- turning items into inputs


def materialize(
    item: ProbeItem,
    backend: Any,
    *,
    storage: torch.dtype | str = torch.float32,
    max_chunk_tokens: int = MAX_CHUNK_TOKENS,
    image_grid: tuple[int, int] | None = None,
) -> MaterializedItem:
    """Encode an item's chunks (canonical, after the backend's root) and tokenize its query.

    Text chunks longer than ``max_chunk_tokens`` are cut; ``image_grid`` overrides every image's
    grid (small test models).
    """
    chunks: list[Chunk] = []
    norm = None
    hidden = int(backend.model.get_input_embeddings().weight.shape[1])
    for j, pc in enumerate(item.chunks):
        if pc.kind == "text":
            ids = tokenize(backend, pc.text or "")[:max_chunk_tokens]
            if not ids:
                raise EmptyChunkError(f"{item.id} chunk {j} tokenizes to nothing")
            chunks.append(backend.encode(token_ids=ids, storage=storage, meta={"probe": item.id, "slot": str(j)}))
        else:
            norm = embedding_norm(backend) if norm is None else norm
            grid = image_grid or pc.grid
            emb = image_span_embeddings(pc.image, grid, hidden, norm)
            chunks.append(backend.encode(embeds=emb, storage=storage, modality="image-emulated",
                                         meta={"probe": item.id, "slot": str(j), "image": pc.image,
                                               "grid": f"{grid[0]}x{grid[1]}"}))
    query = "\n\n" + item.question + query_suffix(backend)
    return MaterializedItem(
        item=item,
        chunks=chunks,
        query_ids=tokenize(backend, query),
        answer_ids=tokenize(backend, item.answer),
    )
