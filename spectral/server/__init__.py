"""The server's processes: launch, children, scheduler, model worker and detokenizer, the IPC
transport and the messages it carries, the data- and tensor-parallel launchers."""
