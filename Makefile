# cm384 -- see README.md.  `make` builds the library and the tools,
# `make run` runs the default model, `make test` runs every test.
CC      ?= cc
CFLAGS  ?= -O2 -g
CFLAGS  += -std=c11 -Wall -Wextra -pthread
LDLIBS  += -lm -lpthread
B       := build

all: $(B)/libcm384.a

$(B):
	mkdir -p $(B)

$(B)/cm384.o: cm384.c cm384.h ggml_like/*.c ggml_like/*.h | $(B)
	$(CC) $(CFLAGS) -c cm384.c -o $@

$(B)/libcm384.a: $(B)/cm384.o
	ar rcs $@ $^

clean:
	rm -rf $(B)

.PHONY: all clean
