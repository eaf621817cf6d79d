import sys

from llmserve_client.http.cli import main

sys.exit(main())
