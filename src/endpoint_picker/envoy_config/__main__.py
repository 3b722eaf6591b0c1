"""``python -m endpoint_picker.envoy_config``: the same as ``epp envoy-config``."""

import sys

from endpoint_picker.envoy_config.cli import main

sys.exit(main())
