"""``python -m endpoint_picker.flags > docs/flags.md``: the flag reference, regenerated."""

import sys

from endpoint_picker.flags.serve import reference

sys.stdout.write(reference())
