import sys

from sglang_exl3.cli.main import main

sys.exit(main())
