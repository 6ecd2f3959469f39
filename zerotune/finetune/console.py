"""What a fine-tuning run prints: rank 0's progress bar and messages, and no library noise.

Every rank imports the same libraries, so each of their warnings would appear once per rank: on ranks
other than 0, transformers, datasets and Python warnings are silenced (errors still show). Two messages are
silenced everywhere because nobody can act on them: bitsandbytes' advice to install ``kernels`` (a package
that downloads code from the hub at run time), peft's calls of names transformers deprecated, and the
colour codes transformers puts in its load report even when the output is not a terminal.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
LIBRARY_DEPRECATIONS = ("`is_gradient_checkpointing` is deprecated",  # peft -> transformers 5
                        "`past_key_values` is deprecated")  # peft's prefix tuning -> transformers 5


class _StripColour(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = ANSI_ESCAPE.sub("", record.msg)
        return True


def quiet_libraries(rank: int) -> None:
    """Call once per process before the model and data are loaded."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    for deprecated in LIBRARY_DEPRECATIONS:  # one library calling another's deprecated name: not the user's to fix
        warnings.filterwarnings("ignore", message=deprecated, category=FutureWarning)
    import datasets
    import transformers

    if not sys.stderr.isatty():  # the load report is logged through transformers' own handler
        for handler in transformers.utils.logging.get_logger().handlers:
            handler.addFilter(_StripColour())
    if rank == 0:
        return

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore")
