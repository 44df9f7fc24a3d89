"""A byte-level tokenizer usable by Megatron-Core's GPT datasets.

Token ids 0..255 are the UTF-8 bytes of the text; id 256 marks the end of a document. The
vocabulary therefore has 257 entries, small enough for a tiny model and for ``uint16`` token
files.

``megatron.core.datasets.gpt_dataset.GPTDatasetConfig`` (megatron-core 0.16 to 0.19) does not
type-check its tokenizer; the datasets only read ``vocab_size``, ``eod``, ``pad`` and
``unique_identifiers`` (and optionally ``eos`` and ``special_tokens_dict``). :class:`ByteTokenizer`
provides those and the usual ``tokenize``/``detokenize`` pair without subclassing a Megatron
class, so this module never imports Megatron.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Iterable

logger = logging.getLogger(__name__)

NUM_BYTE_IDS = 256
"""Ids below this value are raw UTF-8 bytes."""

EOD_ID = 256
"""The end-of-document id."""

NO_PAD_ID = -1
"""The value of :attr:`ByteTokenizer.pad`: the vocabulary holds no padding token.

Megatron's GPT datasets use -1 themselves for positions padded past the end of the data: they
take such positions out of the loss and feed id 0 in their place, so a pad id outside the
vocabulary is what they expect when the tokenizer has none of its own.
"""


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus an end-of-document id 256."""

    def __init__(self) -> None:
        self.unique_identifiers: OrderedDict[str, object] = OrderedDict(
            [("class", type(self).__name__), ("vocab_size", self.vocab_size), ("eod", EOD_ID)]
        )
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    @property
    def vocab_size(self) -> int:
        """The number of ids: 256 bytes and the end-of-document id."""
        return NUM_BYTE_IDS + 1

    @property
    def eod(self) -> int:
        """The end-of-document id, appended after every document."""
        return EOD_ID

    @property
    def eos(self) -> int:
        """The end-of-sequence id; the same as :attr:`eod`."""
        return EOD_ID

    @property
    def pad(self) -> int:
        """:data:`NO_PAD_ID`, as the vocabulary has no padding token."""
        return NO_PAD_ID

    @property
    def vocab(self) -> dict[str, int]:
        """Map from token text to id; bytes are named ``<0x..>``, the end of document ``<eod>``."""
        return {text: token for token, text in self.inv_vocab.items()}

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Map from id to token text, the inverse of :attr:`vocab`."""
        names = {token: f"<0x{token:02X}>" for token in range(NUM_BYTE_IDS)}
        names[EOD_ID] = "<eod>"
        return names

    def tokenize(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ids; no end-of-document id is added."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Return the text of ``ids``, skipping end-of-document ids.

        Byte sequences that are not valid UTF-8 (as a model may sample) decode to U+FFFD.
        Raises ``ValueError`` for an id outside the vocabulary.
        """
        data = bytearray()
        for token in ids:
            token = int(token)
            if token == EOD_ID:
                continue
            if not 0 <= token < NUM_BYTE_IDS:
                raise ValueError(f"token id {token} is outside the vocabulary 0..{EOD_ID}")
            data.append(token)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


def make_byte_tokenizer() -> ByteTokenizer:
    """Return the tokenizer of the shipped corpus and of every dataset built here."""
    return ByteTokenizer()
