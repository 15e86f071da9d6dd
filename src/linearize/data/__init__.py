"""Training and evaluation data: sources -> token documents -> packed rows; synthetic passkeys.

``load_documents`` reads a file, folder, ``shakespeare``, ``passkey[:LENGTH[:COUNT]]`` or a HF
dataset id into token-id documents ending with EOS; ``split_documents`` holds out whole documents
for validation; ``pack`` cuts documents into fixed-length ``Rows`` under a documented policy at
document boundaries (``PACKING_POLICIES``); ``passkey`` builds Lizard's five-passkey and the
classic pass-key retrieval examples.
"""

from .packing import PACKING_POLICIES, Rows, pack, split_documents
from .passkey import PasskeyExample, make_classic_passkey_example, make_passkey_example, passkey_documents
from .sources import load_documents

__all__ = ["PACKING_POLICIES", "PasskeyExample", "Rows", "load_documents", "make_classic_passkey_example",
           "make_passkey_example", "pack", "passkey_documents", "split_documents"]
