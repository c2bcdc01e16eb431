"""What a speculative-token proposer is to the engine: three methods (``spec/proposers.py``
holds the two the package ships).

Plain Python, so that a request (``core/request.py``) can name its proposer's type without
loading torch.
"""

from __future__ import annotations

from typing import Protocol


class Proposer(Protocol):
    """Proposes the tokens a request's next step verifies; what it proposes changes only how
    many tokens a step keeps, never which."""

    def propose(self, items: list) -> list:
        """Per ``ProposalRequest`` of ``items``, a ``Proposal`` (``spec/proposers.py``)."""
        ...

    def observe(self, seq, num_proposed: int, num_accepted: int) -> None:
        """The outcome of verifying ``num_proposed`` tokens proposed for ``seq``."""
        ...

    def release(self, seq) -> None:
        """``seq`` finished: drop what is kept for it."""
        ...


def check_proposer(proposer) -> None:
    """TypeError unless ``proposer`` has ``propose``, ``observe`` and ``release``."""
    missing = [
        m for m in ("propose", "observe", "release") if not callable(getattr(proposer, m, None))
    ]
    if missing:
        raise TypeError(
            f"proposer={proposer!r} is not allowed: it has no {missing} method(s) (see "
            "hf_paged.engine.spec.proposers)"
        )
