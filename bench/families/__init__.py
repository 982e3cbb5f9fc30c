"""The benchmark families, one module each (bench/families/<name>.py), each timing ours
against its baseline; the helpers several of them share are in bench/families/shared/."""
