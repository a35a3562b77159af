"""The names a replica serves its model under (``--served-model-name``) and its model card.

As vLLM: the first served name is the model's id, reported in ``/v1/models`` and in every answer;
a request's ``model`` may be any of them. Without served names the id is the model directory as the
executor loaded it (vLLM reports the path it was given), which tools such as guidellm then load their
tokenizer from. The directory's name (what pagedserve reported before) is always accepted too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scheduler_svc.frontend.watch import ClusterWatch


@dataclass(slots=True)
class Models:
    watch: ClusterWatch
    served: tuple[str, ...] = ()  # --served-model-name
    created: int = 0  # the cards' ``created``: when this replica started

    @property
    def known(self) -> bool:
        """Whether an executor has told the model yet."""
        return bool(self.watch.model)

    @property
    def root(self) -> str:
        """The model directory (the directory's name from an executor that does not send it)."""
        return self.watch.model_path or self.watch.model

    @property
    def id(self) -> str:
        return self.served[0] if self.served else self.root

    def accepts(self, name: str) -> bool:
        return name in self.served or name in (self.root, self.watch.model)

    def cards(self) -> list[dict[str, Any]]:
        """``/v1/models``'s ``data``: one card per served name (vLLM's), empty until the model is known."""
        if not self.known:
            return []
        return [self.card(name) for name in self.served or (self.root,)]

    def adapter_card(self, name: str, path: str) -> dict[str, Any]:
        """A LoRA adapter's card, as vLLM's: its directory as ``root``, the model's id as ``parent``."""
        return self.card(name) | {"root": path, "parent": self.id}

    def card(self, name: str) -> dict[str, Any]:
        limits = self.watch.limits
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedserve",
            "root": self.root,
            "parent": None,
            "max_model_len": limits.max_model_len if limits else None,
        }
