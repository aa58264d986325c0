"""The management endpoints' bodies (POST /dflash/load, POST /dflash/downloads). Unlike the
generating APIs' bodies they refuse unknown fields: the API is ours, so a misspelt field is an
error, not a silent default.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from dflash_local.service.request_fields import BlockSize, StrictModel


class LoadRequest(StrictModel):
    """Load a catalog pair by id, or a target (+ drafter) by repo id from the local cache."""

    model_config = ConfigDict(strict=True, extra="forbid")
    pair: str | None = Field(None, min_length=1, max_length=200)
    engine: str | None = Field(None, min_length=1, max_length=40)
    target: str | None = Field(None, min_length=1, max_length=200)
    drafter: str | None = Field(None, min_length=1, max_length=200)
    block_size: BlockSize | None = None  # default block size for requests
    draft_window: int | None = Field(None, ge=1)  # default draft window (None: the catalog's)
    recalibrate: bool = False  # measure this machine's round costs again (block size auto)

    @model_validator(mode="after")
    def _one_form(self) -> LoadRequest:
        if (self.pair is None) == (self.target is None):
            raise ValueError("give either pair (a catalog id) or target (a repo id), not both")
        if self.pair is not None and self.drafter is not None:
            raise ValueError("drafter goes with target, not with pair")
        return self


class DownloadRequest(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    pair: str = Field(min_length=1, max_length=200)
    context_tokens: int = Field(4096, ge=1, le=10_000_000)  # for the will-it-fit estimate
