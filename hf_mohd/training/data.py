"""Text loading, a corpus-trained BPE tokenizer, and sequence packing.

Documents come from `datasets` (a Hub id when online; local .txt/.json/.jsonl/.parquet files or a `save_to_disk`
folder offline). A fraction of the *documents* is held out for perplexity, so no held-out text is seen in training.
Each split is tokenised, every document is followed by the EOS token, and the stream is cut into blocks of exactly
`seq_len` tokens ("packing", as in GPT-2/LLaMA pretraining): no padding, every token has a label.
"""

import glob
import os

import torch

from .config import DataConfig, TrainConfigError


_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
EOS_TOKEN = "<|endoftext|>"


def _local_files(path: str) -> list[str]:
    if os.path.isdir(path):
        candidates = sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True))
    else:
        candidates = sorted(glob.glob(path))
    return [p for p in candidates if os.path.isfile(p) and os.path.splitext(p)[1] in _BUILDERS]


def load_documents(config: DataConfig) -> list[str]:
    """The documents of `config.path` / `config.split`, as a list of non-empty strings.

    Raises:
        ValueError: mixed file types, a missing `text_field`, or a dataset that cannot be loaded (offline and not
            cached, misspelt id); the message names `data.path` or `data.text_field`.
    """
    import datasets

    path = config.path
    looks_local = os.path.exists(path) or any(ch in path for ch in "*?") or os.path.splitext(path)[1] in _BUILDERS
    try:
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
            dataset = datasets.load_from_disk(path)
            if isinstance(dataset, datasets.DatasetDict):
                dataset = dataset[config.split]
        elif looks_local:
            files = _local_files(path)
            if not files:
                raise TrainConfigError(f"`data.path` {path!r} matches no .txt/.json/.jsonl/.parquet file.", "missing")
            kinds = {_BUILDERS[os.path.splitext(f)[1]] for f in files}
            if len(kinds) > 1:
                raise TrainConfigError(f"`data.path` {path!r} mixes file types {sorted(kinds)}; point it at one kind.")
            dataset = datasets.load_dataset(kinds.pop(), data_files={"train": files}, split="train")
        else:
            dataset = datasets.load_dataset(path, config.name or None, split=config.split)
    except ValueError:
        raise
    except Exception as error:
        raise TrainConfigError(
            f"Cannot load `data.path` {path!r} (split {config.split!r}): {error}. Offline, give local files."
        ) from error
    if config.text_field not in dataset.column_names:
        raise TrainConfigError(
            f"`data.text_field` {config.text_field!r} is not a column of {path!r}; columns: {dataset.column_names}."
        )
    texts = [t for t in dataset[config.text_field] if isinstance(t, str) and t.strip()]
    if config.max_documents:
        texts = texts[: config.max_documents]
    if not texts:
        raise TrainConfigError(
            f"`data.path` {path!r} holds no non-empty text in field {config.text_field!r}.", "damaged"
        )
    return texts


def split_documents(texts: list[str], eval_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Deterministic document-level split: (train, held-out). At least one document stays in training."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(texts), generator=generator).tolist()
    n_eval = min(int(round(eval_fraction * len(texts))), len(texts) - 1)
    held_out = sorted(order[:n_eval])
    train = sorted(order[n_eval:])
    return [texts[i] for i in train], [texts[i] for i in held_out]


def train_bpe_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2 style, so every string is encodable) trained on `texts`.

    Returns a `PreTrainedTokenizerFast` with `<|endoftext|>` as BOS, EOS and padding token. A small vocabulary keeps
    the embedding of a tiny model from dominating its parameter count (docs/design.md section 7).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )


def pack(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenise, append EOS to each document, concatenate and cut into (num_blocks, seq_len) int64 blocks."""
    if tokenizer.eos_token_id is None:
        raise ValueError("The tokenizer has no EOS token; packing needs one to separate documents.")
    ids: list[int] = []
    for start in range(0, len(texts), 256):
        for doc in tokenizer(texts[start : start + 256], add_special_tokens=False)["input_ids"]:
            ids.extend(doc)
            ids.append(tokenizer.eos_token_id)
    num_blocks = len(ids) // seq_len
    return torch.tensor(ids[: num_blocks * seq_len], dtype=torch.long).view(num_blocks, seq_len)


class PackedBatches:
    """Deterministic micro-batches of packed blocks for one process, resumable from (epoch, index).

    Epoch e visits the blocks in `randperm(num_blocks, seed + e)` order; each micro-step takes the next
    `micro_batch_size * num_processes` blocks and gives this process its contiguous slice. The position after a
    micro-batch is a pair of integers, which the trainer saves in its checkpoint: resuming needs no data replay.
    """

    def __init__(self, blocks: torch.Tensor, micro_batch_size: int, seed: int, process_index: int, num_processes: int):
        self.blocks = blocks
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank, self.world = process_index, num_processes
        self.steps_per_epoch = len(blocks) // (micro_batch_size * num_processes)
        if self.steps_per_epoch == 0:
            raise TrainConfigError(
                f"The training split has {len(blocks)} packed blocks, fewer than one global micro-batch "
                f"({micro_batch_size} x {num_processes} processes): lower `micro_batch_size` or `data.seq_len`, or "
                "give more text."
            )

    def iterate(self, epoch: int = 0, index: int = 0):
        """Yield (epoch, index_after, input_ids) forever, starting at micro-step `index` of `epoch`."""
        while True:
            order = torch.randperm(len(self.blocks), generator=torch.Generator().manual_seed(self.seed + epoch))
            for i in range(index, self.steps_per_epoch):
                start = (i * self.world + self.rank) * self.micro_batch_size
                yield epoch, i + 1, self.blocks[order[start : start + self.micro_batch_size]]
            epoch, index = epoch + 1, 0
