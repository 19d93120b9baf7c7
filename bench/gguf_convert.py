"""Convert a bench checkpoint to GGUF with llama.cpp's own converter, so llama.cpp runs the same weights.

llama.cpp's `convert_hf_to_gguf.py` identifies a BPE tokenizer's pre-tokenizer by hashing the
token ids it gives for a fixed text and looking the hash up in a table of known models; the bench
checkpoints carry this repo's own trained tokenizer, whose hash is in no table, so the converter
stops with "BPE pre-tokenizer was not recognized". The tokenizer is a plain byte-level BPE
(`pre_tokenizers.ByteLevel(add_prefix_space=False)` with its default GPT-2 split regex, see
moe_runtime/demo/tokenizer_training.py), which is exactly llama.cpp's "gpt-2" pre-tokenizer. So this
module runs the converter with `TextModel.get_vocab_base_pre` wrapped: a recognised hash keeps
its name, an unrecognised one becomes "gpt-2". Nothing in the llama.cpp tree is edited.

Run as a script it is that patched converter (one conversion per process, the converter's
globals and logging stay out of the caller):

    python bench/gguf_convert.py --converter-dir LLAMA_CPP_SRC CHECKPOINT_DIR OUT.gguf {f32,bf16,q8_0}
"""
from __future__ import annotations

import argparse
import logging
import runpy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FALLBACK_PRE_TOKENIZER = "gpt-2"
CONVERTER_SCRIPT = "convert_hf_to_gguf.py"
# GGUF file type (llama.cpp's name, used in file names and tables) -> the converter's --outtype.
OUTTYPE_OF_FILE_TYPE = {"F32": "f32", "BF16": "bf16", "Q8_0": "q8_0"}

logger = logging.getLogger("gguf_convert")


@dataclass(frozen=True)
class GgufTarget:
    """One GGUF file to have: `checkpoint` (an HF directory) written as `file_type` under `gguf_dir`."""
    checkpoint: Path
    file_type: str          # a key of OUTTYPE_OF_FILE_TYPE
    gguf_dir: Path

    @property
    def path(self) -> Path:
        return self.gguf_dir / f"{self.checkpoint.name}-{self.file_type}.gguf"

    def is_current(self) -> bool:
        """The file exists and is newer than the checkpoint's weights (a rebuilt checkpoint needs a new one)."""
        if not self.path.exists():
            return False
        weights = list(self.checkpoint.glob("*.safetensors"))
        return all(self.path.stat().st_mtime >= w.stat().st_mtime for w in weights)


def ensure_gguf(target: GgufTarget, converter_dir: Path | None) -> Path:
    """The target's GGUF file, converted now (in a subprocess) when missing or stale and a converter is given."""
    if target.is_current():
        return target.path
    if converter_dir is None:
        raise FileNotFoundError(
            f"{target.path} is missing or older than {target.checkpoint}: pass --llama-cpp-src (the llama.cpp "
            f"source tree with {CONVERTER_SCRIPT}) to convert it, see docs/llama_cpp.md")
    target.gguf_dir.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to %s", target.checkpoint, target.path)
    command = [sys.executable, str(Path(__file__).resolve()), "--converter-dir", str(converter_dir),
               str(target.checkpoint), str(target.path), OUTTYPE_OF_FILE_TYPE[target.file_type]]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"converting {target.checkpoint} to {target.file_type} failed:\n{completed.stderr[-4000:]}")
    return target.path


def accept_unknown_pre_tokenizer(text_model_class) -> None:
    """Make the converter name an unrecognised BPE pre-tokenizer FALLBACK_PRE_TOKENIZER instead of stopping."""
    recognise = text_model_class.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return recognise(self, tokenizer)
        except NotImplementedError:
            logger.warning("pre-tokenizer hash not in llama.cpp's table: writing %r (byte-level BPE, GPT-2 regex)",
                           FALLBACK_PRE_TOKENIZER)
            return FALLBACK_PRE_TOKENIZER

    text_model_class.get_vocab_base_pre = get_vocab_base_pre


def skip_absent_sentencepiece(text_model_class) -> None:
    """Dense Llama/Qwen converters try a SentencePiece vocabulary first and fall back to BPE on FileNotFoundError,
    but import `sentencepiece` before looking for `tokenizer.model`: without the package (not needed here) that
    import stops them. With no `tokenizer.model` the attempt now fails as the fallback expects."""
    load_sentencepiece = text_model_class._set_vocab_sentencepiece

    def _set_vocab_sentencepiece(self, *args, **kwargs):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"no tokenizer.model in {self.dir_model}")
        return load_sentencepiece(self, *args, **kwargs)

    text_model_class._set_vocab_sentencepiece = _set_vocab_sentencepiece


def run_patched_converter(converter_dir: Path, checkpoint: Path, out: Path, outtype: str) -> None:
    """Import the converter's `conversion` package from `converter_dir`, patch it, run its script as __main__."""
    converter_dir = converter_dir.resolve()
    sys.path.insert(0, str(converter_dir))
    sys.path.insert(1, str(converter_dir / "gguf-py"))    # the converter's own gguf, as its script does
    from conversion.base import TextModel

    accept_unknown_pre_tokenizer(TextModel)
    skip_absent_sentencepiece(TextModel)
    sys.argv = [CONVERTER_SCRIPT, str(checkpoint), "--outfile", str(out), "--outtype", outtype]
    runpy.run_path(str(converter_dir / CONVERTER_SCRIPT), run_name="__main__")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--converter-dir", type=Path, required=True, help=f"llama.cpp source tree ({CONVERTER_SCRIPT})")
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("outtype", choices=sorted(OUTTYPE_OF_FILE_TYPE.values()))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    run_patched_converter(args.converter_dir, args.checkpoint, args.out, args.outtype)


if __name__ == "__main__":
    main()
