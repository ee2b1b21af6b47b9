# cm384 -- see README.md.
#
#   make            the library (build/libcm384.a), the cm384 tool and examples
#   make run        generate with the default model and show the supernode report
#   make test       every test: unit, golden, engine, ASan+UBSan, TSan, valgrind
#   make bench      this machine's limits, then cm384 against them
#   make fuzz       the fuzz harnesses (build/fuzz/fuzz_NAME; tests/fuzz/README.md)
#   make peer       build llama.cpp beside the repository, for make bench
#   make install    PREFIX=/usr/local DESTDIR=
#   make amalgamation  dist/cm384.c (kernels inlined) + dist/cm384.h
#
# The library is one translation unit: `cc -O3 -c cm384.c` builds it all (-O2
# works; its kernels run slower: README, Embedding).

# the sanitizer builds compile the library many times: use every core
MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 2)

CC      ?= cc
CFLAGS  ?= -O3 -g
CFLAGS  += -std=c11 -Wall -Wextra -pthread
LDLIBS  += -lm -lpthread
PREFIX  ?= /usr/local
B       := build
SRC     := cm384.c cm384.h $(wildcard ggml_like/*.c ggml_like/*.h)

# the built-in default model: the trained one when present, else the fixture
MODEL   ?= $(if $(wildcard models/shakespeare/config.json),models/shakespeare,tests/fixtures/tiny-dsv3)
PROMPT  ?= ROMEO:
NTOK    ?= 100

all: $(B)/libcm384.a $(B)/cm384 $(B)/embed $(B)/cm384-server

$(B) $(B)/asan $(B)/tsan:
	@mkdir -p $@

# two objects, so that make's two jobs build them at once (cm384.c alone,
# which includes the kernels, is the same library: `cc -c cm384.c`)
$(B)/cm384.o: cm384.c cm384.h ggml_like/ggml_like.h ggml_like/unicode_data.h | $(B)
	$(CC) $(CFLAGS) -DCM384_KERNELS_APART -c cm384.c -o $@

$(B)/ggml_like.o: $(wildcard ggml_like/*.c ggml_like/*.h) | $(B)
	$(CC) $(CFLAGS) -c ggml_like/ggml_like.c -o $@

$(B)/libcm384.a: $(B)/cm384.o $(B)/ggml_like.o
	ar rcs $@ $^

# the programs' objects need only cm384.h: they compile while the kernels do
$(B)/ex_%.o: examples/%.c cm384.h | $(B)
	$(CC) $(CFLAGS) -c $< -o $@

$(B)/cm384: $(B)/ex_cm384.o $(B)/ex_cm384_project.o $(B)/libcm384.a
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

$(B)/embed: $(B)/ex_embed.o $(B)/libcm384.a
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

# the OpenAI-compatible server (examples/server.c): libc, pthreads, sockets
$(B)/cm384-server: $(B)/ex_server.o $(B)/libcm384.a
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

# the amalgamation: one cm384.c with the ggml_like kernels inlined, and
# cm384.h -- two files to embed (generated into dist/, not committed)
DIST := dist
amalgamation: $(DIST)/cm384.c $(DIST)/cm384.h

$(DIST)/cm384.c: $(SRC) tools/amalgamate.sh
	@mkdir -p $(DIST)
	sh tools/amalgamate.sh cm384.c > $@.tmp && mv $@.tmp $@

$(DIST)/cm384.h: cm384.h
	@mkdir -p $(DIST)
	cp cm384.h $@

# the embedding example built from those two files alone, in a folder that
# holds nothing else
$(B)/embed-amalgamated: $(DIST)/cm384.c $(DIST)/cm384.h examples/embed.c | $(B)
	rm -rf $(B)/amalg && mkdir -p $(B)/amalg/examples
	cp $(DIST)/cm384.c $(DIST)/cm384.h $(B)/amalg/ && cp examples/embed.c $(B)/amalg/examples/
	cd $(B)/amalg && $(CC) $(CFLAGS) examples/embed.c cm384.c -o embed $(LDLIBS)
	cp $(B)/amalg/embed $@

# the server and the library under ThreadSanitizer, for the server test
$(B)/tsan/cm384-server: examples/server.c $(SRC) | $(B)/tsan
	$(CC) -std=c11 -Wall -Wextra -pthread $(SAN) -fsanitize=thread examples/server.c cm384.c -o $@ $(LDLIBS)

$(B)/gen_synth: models/gen/gen_synth.c | $(B)
	$(CC) -O2 -std=c11 -Wall -Wextra models/gen/gen_synth.c -o $@ -lm

# sampled (temperature 0.8, top-p 0.95, seed 1), with MTP speculative decoding
# then the run projected on CloudMatrix384: the text report and the picture
# are left in $(B)/ (docs/how-it-works.md says how to read them)
run: $(B)/cm384
	./$(B)/cm384 run -m $(MODEL) -p "$(PROMPT)" -n $(NTOK) --temp 0.8 --top-p 0.95 --seed 1 --mtp-always --report
	./$(B)/cm384 project --from-run $(MODEL) --svg $(B)/report.svg > $(B)/report.txt
	@echo "the run projected on CloudMatrix384: $(B)/report.txt, picture: $(B)/report.svg"

# ---- tests ----
# The test areas (tests/test_*.c) include cm384.c to reach internals and are
# compiled together with it into one program per configuration (tests/main.c),
# so the library is compiled once for plain, once for ASan+UBSan and once for
# TSan.  `build/cm384_tests AREA` runs one area; tests/run.sh runs them all and
# sums their "name: N passed, N failed" lines.

TEST_SRC := tests/main.c tests/test.h $(wildcard tests/test_*.c)
SAN      := -O1 -g -fno-omit-frame-pointer
# the alloc area counts allocations through GNU ld's --wrap
ifeq ($(shell uname -s),Linux)
TEST_WRAP := -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc
else
TEST_WRAP := -DCM384_TEST_NO_WRAP
endif

$(B)/cm384_tests: $(TEST_SRC) $(SRC) | $(B)
	$(CC) $(CFLAGS) tests/main.c -o $@ $(LDLIBS) $(TEST_WRAP)

$(B)/asan/cm384_tests: $(TEST_SRC) $(SRC) | $(B)/asan
	$(CC) -std=c11 -Wall -Wextra -pthread $(SAN) -fsanitize=address,undefined -fno-sanitize-recover=undefined tests/main.c -o $@ $(LDLIBS) $(TEST_WRAP)

$(B)/tsan/cm384_tests: $(TEST_SRC) $(SRC) | $(B)/tsan
	$(CC) -std=c11 -Wall -Wextra -pthread $(SAN) -fsanitize=thread tests/main.c -o $@ $(LDLIBS) $(TEST_WRAP)

test-bins: all $(B)/gen_synth $(B)/embed-amalgamated $(B)/tsan/cm384-server $(B)/cm384_tests $(B)/asan/cm384_tests $(B)/tsan/cm384_tests \
           $(B)/fuzz/cm384_fuzz

test: test-bins
	@B=$(B) MODEL=$(MODEL) CC="$(CC)" sh tests/run.sh

# ---- fuzzing (tests/fuzz/README.md) ----
# One program holds every harness (the library is compiled once); fuzz_NAME
# are links to it.  With clang's libFuzzer when it links, else a standalone
# build that replays the corpus and then mutates it for -runs=N runs.
# The harnesses parse; the kernels they reach run in the scalar set
# (GL_NO_SIMD): the SIMD sets are checked against it by test_kernels, under
# ASan+UBSan too, and left out here they no longer take most of this
# build's time.
FUZZ_CC    ?= clang
FUZZ_FLAGS := -std=c11 -Wall -Wextra -pthread $(SAN) -DCM384_ARENA_CHUNK=0 -DGL_NO_SIMD \
              -fsanitize=address,undefined -fno-sanitize-recover=undefined

$(B)/fuzz:
	@mkdir -p $@

$(B)/fuzz/cm384_fuzz: $(wildcard tests/fuzz/*.c tests/fuzz/*.h) tests/fuzz/coverage.ignore $(SRC) | $(B)/fuzz
	@if echo 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return d && n; }' | \
	    $(FUZZ_CC) -x c - -fsanitize=fuzzer -o $(B)/fuzz/probe >/dev/null 2>&1; then \
	    echo "$(FUZZ_CC) -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_main.c -o $@"; \
	    $(FUZZ_CC) $(FUZZ_FLAGS) -fsanitize=fuzzer -fsanitize-coverage-ignorelist=tests/fuzz/coverage.ignore \
	        tests/fuzz/fuzz_main.c -o $@ $(LDLIBS); \
	else \
	    echo "no libFuzzer ($(FUZZ_CC) -fsanitize=fuzzer does not link): standalone harnesses"; \
	    $(CC) $(FUZZ_FLAGS) -DCM384_FUZZ_STANDALONE tests/fuzz/fuzz_main.c -o $@ $(LDLIBS); \
	fi
	@rm -f $(B)/fuzz/probe
	@for t in $$(./$@ -list | cut -d' ' -f1); do ln -sf cm384_fuzz $(B)/fuzz/fuzz_$$t; done

fuzz: $(B)/fuzz/cm384_fuzz

# cm384 and llama.cpp on the same GGUF files (needs the peer: tests/peer/build-llama.sh)
check-peer: all $(B)/gen_synth $(B)/cm384_tests
	@B=$(B) sh tests/peer/check-peer.sh $(CHECK_PEER_FLAGS)

# ---- benchmarks ----
bench: all $(B)/gen_synth $(B)/bench_kernels
	@B=$(B) sh tests/bench.sh

$(B)/bench_kernels: tests/bench_kernels.c $(SRC) | $(B)
	$(CC) $(CFLAGS) tests/bench_kernels.c -o $@ $(LDLIBS)

# llama.cpp as a test peer (from the npm package node-llama-cpp), built with
# native flags outside the repository: PEER_DIR (default ../peer beside the
# main checkout); `make bench` then runs llama-bench beside cm384 with
# LLAMA_BENCH=$(PEER_DIR)/bin/llama-bench
peer:
	sh tests/peer/build-llama.sh $(PEER_DIR)

# ---- install ----
install: $(B)/libcm384.a $(B)/cm384
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 644 $(B)/libcm384.a $(DESTDIR)$(PREFIX)/lib/
	install -m 644 cm384.h $(DESTDIR)$(PREFIX)/include/
	install -m 755 $(B)/cm384 $(DESTDIR)$(PREFIX)/bin/
	sed -e 's|@PREFIX@|$(PREFIX)|' cm384.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/cm384.pc

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/lib/libcm384.a $(DESTDIR)$(PREFIX)/include/cm384.h \
	      $(DESTDIR)$(PREFIX)/bin/cm384 $(DESTDIR)$(PREFIX)/lib/pkgconfig/cm384.pc

clean:
	rm -rf $(B) $(DIST)

.PHONY: all run test test-bins fuzz bench peer install uninstall clean amalgamation check-peer
