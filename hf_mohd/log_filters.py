# Copyright 2026 The hf-mohd Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Library warnings about what this package does by design, silenced only where it does it."""

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def filtered_loggers(log_filter: logging.Filter, *names: str) -> Iterator[None]:
    """Within the block, `log_filter` filters the loggers `names` (e.g. "accelerate.utils.other"); it is removed
    afterwards, also when the block raises."""
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addFilter(log_filter)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(log_filter)
