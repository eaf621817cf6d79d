import sys

from llmserve_bench.cli import main

sys.exit(main())
