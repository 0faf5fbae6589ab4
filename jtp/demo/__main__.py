"""python -m jtp.demo DIR: build the demo checkpoint into DIR (fresh, no cache); needs the demo extra."""
import sys

from jtp.demo.build import main

sys.exit(main())
