"""`python -m spectral.launch_server --model-path ...`: run the HTTP server."""

from spectral.server.launch import main

if __name__ == "__main__":
    main()
