import sys

from llmserve_core.cli import main

sys.exit(main())
