"""Training and evaluation data: sources -> token documents -> packed rows; mixtures; synthetic passkeys.

``load_documents`` reads a file (plain or .gz/.xz/.bz2), folder, ``shakespeare``,
``passkey[:LENGTH[:COUNT]]`` or a HF dataset id into token-id ``Document`` s ending with EOS (chat
and Alpaca records carry an assistant ``loss_mask``); ``load_mixture`` reads several sources with
weights (``"a.jsonl.xz:0.6,b.jsonl.xz:0.4"``, ``parse_data_spec``) into one training stream with
validation documents held out per source; ``split_documents`` holds out whole documents for
validation; ``pack`` cuts documents into fixed-length ``Rows`` under a documented policy at document
boundaries (``PACKING_POLICIES``); ``passkey`` builds Lizard's five-passkey and the classic pass-key
retrieval examples (evaluation; the classic one never for training); ``retrieval`` builds training
retrieval examples in other formats (``retrieval:FORMAT...`` sources).
"""

from .mixture import Mixture, format_data_spec, load_mixture, mix_documents, parse_data_spec
from .packing import PACKING_POLICIES, Rows, pack, split_documents, trim_bucket
from .passkey import PasskeyExample, make_classic_passkey_example, make_passkey_example, passkey_documents
from .retrieval import QuizExample, RetrievalExample, make_fact_example, make_kv_example, make_quiz_example, retrieval_documents
from .sources import Document, load_documents

__all__ = ["Document", "Mixture", "PACKING_POLICIES", "PasskeyExample", "Rows", "format_data_spec", "load_documents",
           "load_mixture", "make_classic_passkey_example", "make_passkey_example", "mix_documents", "pack",
           "parse_data_spec", "passkey_documents", "retrieval_documents", "split_documents", "trim_bucket",
           "QuizExample", "RetrievalExample", "make_fact_example", "make_kv_example", "make_quiz_example"]
