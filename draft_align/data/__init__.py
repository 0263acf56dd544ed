"""Chat data: conversations loaded from files, the hub or the embedded default, held-out splits, and
tokenisation with an assistant loss mask.

``draft_align.data`` is the API the loops and examples import; its rooms: ``conversations.py`` (the chat types
and :class:`DataError`), ``loading.py`` (rows, files and role normalisation; held-out splits), ``encoding.py``
(chat templates and loss masks), ``tasks.py`` (verifiable-reward problems generated in-process, ``task:NAME``
sources, and their answer check)."""

from draft_align.data.conversations import ROLES, Conversation, DataError, EncodedSample, Message
from draft_align.data.encoding import encode_conversation, encode_prompt, encode_response
from draft_align.data.loading import FILE_SUFFIXES, ROLE_ALIASES, load_conversations, split_heldout

__all__ = [
    "FILE_SUFFIXES",
    "ROLES",
    "ROLE_ALIASES",
    "Conversation",
    "DataError",
    "EncodedSample",
    "Message",
    "encode_conversation",
    "encode_prompt",
    "encode_response",
    "load_conversations",
    "split_heldout",
]
