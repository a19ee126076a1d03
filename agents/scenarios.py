"""The demo's scenarios: the material each agent works on in ``contextdeque demo`` (the CLI in
``contextdeque.cli.demo`` shows them).

- doc: twelve sections of the Python language reference (``pydoc_data.topics``, shipped with
  Python) as one document, and four questions about it;
- web: a tour of Python's own documentation server (``python -m pydoc``);
- video: a clip built from scikit-image's photographs (pans, zooms, drifting crops), watched
  segment by segment with look-backs and comparisons.
"""

from __future__ import annotations

from typing import Any, Callable

from .base import AgentConfig, AgentRun, Step

DOC_TOPICS = ("assert", "pass", "del", "return", "break", "continue", "global", "nonlocal", "yield",
              "lambda", "if", "while")
"""Sections of ``pydoc_data.topics`` the demo document is made of (about 2,300 tokens)."""

DOC_QUESTIONS = (
    "What happens when the pass statement is executed?",
    "Which loop does the break statement terminate?",
    "How does the global statement make the listed identifiers be interpreted?",
    "What does the nonlocal statement make the listed identifiers refer to?",
)


def demo_document(topics: tuple[str, ...] = DOC_TOPICS) -> str:
    """The demo's document: sections of the Python language reference, from ``pydoc_data``."""
    from pydoc_data.topics import topics as all_topics

    return "\n\n".join(all_topics[k].strip() for k in topics)


def run_doc(backend: Any, config: AgentConfig, on_step: Callable[[Step], None] | None = None, *,
            questions: tuple[str, ...] = DOC_QUESTIONS, page_tokens: int = 160,
            topics: tuple[str, ...] = DOC_TOPICS) -> AgentRun:
    from .doc import DocAgent

    agent = DocAgent(backend, config, page_tokens=page_tokens, on_step=on_step)
    return agent.answer(demo_document(topics), list(questions))


def run_web(backend: Any, config: AgentConfig, on_step: Callable[[Step], None] | None = None, *,
            topics: int = 3) -> AgentRun:
    from .web import run_tour

    return run_tour(backend, config, on_step, topics=topics)


def run_video(backend: Any, config: AgentConfig, on_step: Callable[[Step], None] | None = None, *,
              segments: int = 4, processor: Any = None, video: Any = None, every: int = 2,
              frames_per_segment: int = 3, image_tokens: int = 36) -> Any:
    """Watch ``video`` (default: the clip built from ``skimage.data`` photographs); returns the
    ``VideoAgent`` (its ``run`` and its ``summary()`` with the vision-tower counts)."""
    from .video import VideoAgent

    agent = VideoAgent(backend, config, processor=processor, frames_per_segment=frames_per_segment,
                       image_tokens=image_tokens, on_step=on_step)
    agent.watch(video, every=every, segments=segments)
    return agent


AGENTS = ("doc", "web", "video")


def default_rank(agent: str) -> int:
    """The patch rank ``agent`` (one of :data:`AGENTS`) uses when its config names none: its
    class's ``default_rank``."""
    if agent == "doc":
        from .doc import DocAgent as cls
    elif agent == "web":
        from .web import WebAgent as cls  # type: ignore[assignment]
    else:
        from .video import VideoAgent as cls  # type: ignore[assignment]
    return int(cls.default_rank)
