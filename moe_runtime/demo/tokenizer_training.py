"""Train a small byte-level BPE tokenizer from text that ships with Python.

The demo model and the test checkpoints need a real tokenizer (byte-level BPE, special tokens,
a chat template) without downloading anything. The corpus is the docstrings of a fixed, sorted
list of standard-library modules read from the running interpreter, so a build is deterministic
for a given Python version (the stdlib text differs a little between Python versions).
"""

from __future__ import annotations

import ast
import json
import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"   # a class name transformers 4.x and 5.x both load

# ChatML-like: <|bos|><|im_start|>role\ncontent<|im_end|>\n ... then the assistant header when
# a generation prompt is asked for. Generation of a chat turn ends at <|im_end|> (or <|eos|>).
# Tools in the Hermes/Qwen format (as Qwen2.5's template writes them): with `tools`, a system turn
# lists them as JSON inside <tools></tools> (the conversation's own system message, if first, is
# merged into it); an assistant's `tool_calls` are written as <tool_call>{"name", "arguments"}
# </tool_call>, and tool results as <tool_response> blocks in one user turn per run of tool
# messages. Without tools or tool messages the text is plain ChatML.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '"
    " + '<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": '"
    " + '<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + message['content'] }}"
    "{% for call in message['tool_calls'] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Stdlib modules whose docstrings form the corpus: English prose with code-like words. Paths are
# relative to the stdlib directory; the ones a Python version lacks are skipped.
CORPUS_MODULES = (
    "argparse.py",
    "calendar.py",
    "collections/__init__.py",
    "dataclasses.py",
    "datetime.py",
    "difflib.py",
    "email/message.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "http/client.py",
    "inspect.py",
    "json/__init__.py",
    "logging/__init__.py",
    "pathlib.py",
    "pydoc.py",
    "random.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
    "typing.py",
    "unittest/case.py",
    "urllib/parse.py",
    "_pydecimal.py",
)


@dataclass(frozen=True)
class TokenizerSpec:
    """What to train. `vocab_size` counts the special tokens and the 256 byte tokens."""

    vocab_size: int = 4096
    corpus_modules: tuple[str, ...] = CORPUS_MODULES
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS
    model_max_length: int = 2048


def stdlib_docstrings(modules: tuple[str, ...] = CORPUS_MODULES) -> list[str]:
    """Docstrings (module, class, function) of `modules`, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    for rel in sorted(modules):
        path = stdlib / rel
        if not path.is_file():
            logger.debug("corpus module %s missing in this Python; skipped", path)
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        nodes = [tree] + [
            n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for node in nodes:
            doc = ast.get_docstring(node, clean=True)
            if doc:
                texts.append(doc)
    if not texts:
        raise RuntimeError(f"no corpus text found under the stdlib directory {stdlib}")
    return texts


def train_tokenizer(spec: TokenizerSpec = TokenizerSpec()):
    """Train and return a `transformers.PreTrainedTokenizerFast` for `spec`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    min_size = 256 + len(spec.special_tokens)
    if spec.vocab_size <= min_size:
        raise ValueError(f"TokenizerSpec.vocab_size={spec.vocab_size} must exceed {min_size} (bytes + specials)")

    corpus = stdlib_docstrings(spec.corpus_modules)
    logger.info("training byte-level BPE (vocab %d) on %d docstrings", spec.vocab_size, len(corpus))

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=2,
        special_tokens=list(spec.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    if backend.get_vocab_size() != spec.vocab_size:
        raise RuntimeError(
            f"trained vocab has {backend.get_vocab_size()} tokens, wanted {spec.vocab_size}: corpus too small"
        )

    bos_id = backend.token_to_id(BOS_TOKEN)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Byte-level BPE needs no unknown token. Saying so explicitly (null in tokenizer_config.json)
        # stops class-specific loaders (AutoTokenizer picks Qwen2Tokenizer for model_type qwen2)
        # from adding their default "<|endoftext|>" and growing the vocab past the model's.
        unk_token=None,
        additional_special_tokens=[t for t in spec.special_tokens if t not in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)],
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.model_max_length,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer, path: str | Path) -> Path:
    """`save_pretrained` into `path` (created), loadable with `AutoTokenizer.from_pretrained` by every
    transformers version the project accepts (see `portable_tokenizer_config`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    config_file = path / TOKENIZER_CONFIG_FILE
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config_file.write_text(json.dumps(portable_tokenizer_config(config), indent=2, ensure_ascii=False) + "\n",
                           encoding="utf-8")
    return path


def portable_tokenizer_config(config: dict) -> dict:
    """`tokenizer_config.json` as transformers 4.57 (the oldest accepted) and 5.x both read it.

    transformers 5 saves a fast tokenizer as `tokenizer_class: "TokenizersBackend"` (its new name for
    that class) with the extra special tokens as a list under `extra_special_tokens`. transformers 4.x
    knows no class of that name ("Tokenizer class TokenizersBackend does not exist") and reads
    `extra_special_tokens` as a dict of named tokens (a list fails). `PreTrainedTokenizerFast` and a
    list under `additional_special_tokens` mean the same thing to both.
    """
    portable = dict(config)
    portable["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
    extra = portable.get("extra_special_tokens")
    if isinstance(extra, list):
        del portable["extra_special_tokens"]
        portable["additional_special_tokens"] = extra
    return portable


def chat_stop_token_ids(tokenizer) -> list[int]:
    """Token ids that end a generation: <|eos|> and, for chat turns, <|im_end|>."""
    return [tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(IM_END_TOKEN)]
